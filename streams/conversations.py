"""The conversation scope in the worker: a repartition of compact call records by conversation.

A conversation's traces land on different partitions (they are keyed by trace id), so the span
agent cannot decide across them. Instead its guard records each counted call and usage change of
a trace that names a conversation (`ConversationRecorder`), and the span agent sends them, with
the batch's other records, to the conversation topic keyed by conversation id. The conversation
agent (`ConversationAgent`) reads that topic, keeps each conversation's `ConversationState` in a
table keyed by conversation id (its changelog follows the partition a record arrives on, as the
trace table's does), and sends its decisions down the trace decisions' path: detections topic,
signed kill signal, and from the detections topic paging and the webhook.

What the records hold: ids, the call's key (tool name, hashes of its arguments and result), its
span id and end time, token and cost deltas; never arguments. One Kafka record per partition of
the conversation topic and span batch, holding the conversations whose partition it is:
`{"v": 2, "c": {conversation id: [record, ...], ...}}` (version 1, one conversation's
`{"v": 1, "r": [...]}` with its id in the key, is still read).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import faust
from aiokafka.partitioner import murmur2
from faust.types import EventT

from spanguard import compact_json
from spanguard.detection.conversation import (
    ConversationCall,
    ConversationGuard,
    ConversationState,
    ConversationUsage,
)
from spanguard.detection.pipeline import MAX_RECORD_BYTES, Outcome
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.schemas.decision import Decision
from spanguard.schemas.policy import Policy
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.delivery import Send
from spanguard.streams.faust_internals import event_context
from spanguard.streams.fence import Lease
from spanguard.streams.state_table import StateTable
from spanguard.streams.write_back import ScopeAgent

if TYPE_CHECKING:
    from spanguard.streams.wiring import Worker

__all__ = [
    "MAX_RECENT_SPANS",
    "PACKED_VERSION",
    "RECORD_VERSION",
    "ConversationAgent",
    "ConversationCount",
    "ConversationRecorder",
    "WorkerConversations",
    "conversation_partition",
    "conversation_sends",
    "conversation_tally",
    "conversation_view",
    "conversations_wanted",
    "decode_records",
    "encode_packs",
]

log = logging.getLogger("spanguard.worker")

# 1: one conversation's records, its id in the key (still read: a worker of an earlier
# release may have sent them); 2: a pack of the conversations of one partition.
RECORD_VERSION = 1
PACKED_VERSION = 2
_PACK_HEAD = b'{"v":2,"c":{'
# Span ids a conversation remembers to drop records sent twice (a span batch decided again
# after a crash re-sends what it had sent): a commit interval's calls of one conversation.
MAX_RECENT_SPANS = 256
# Conversations whose idle state is deleted per batch at most: bounded work.
EVICT_PER_BATCH = 256
# Longest text field a record may carry (trace ids are 32 hex, names are bounded upstream).
MAX_FIELD_CHARS = 512

Record = ConversationCall | ConversationUsage


@dataclass
class Pack:
    """One record of the conversation topic: where it goes, its key (a lone conversation's
    id, else none), its value, and the conversations it holds."""

    partition: int
    key: bytes | None
    value: bytes
    conversations: list[str]


def conversations_wanted(policy: Policy) -> bool:
    """Whether any policy entry turns the conversation scope on: when none does, the worker
    builds none of it (no conversation keys read, no record sent)."""
    return policy.defaults.conversation_enabled or any(
        rule.policy.conversation_enabled for rule in policy.rules
    )


class ConversationCount(CountedOutcome):
    """What the conversation scope counts in the worker."""

    RECORDS_SENT = "conversation_records_sent"
    RECORDS_READ = "conversation_records_read"
    DUPLICATES = "conversation_duplicates"
    DECISIONS = "conversation_decisions"
    EVICTED = "conversations_evicted"


def conversation_tally(worker: Worker) -> Tally:
    """Where the span agent and the conversation agent count (streams/app.py makes it)."""
    tally = worker.counted[ConversationCount]
    assert isinstance(tally, Tally)
    return tally


# -- the trace side: record, do not decide ----------------------------------------------------


class ConversationRecorder(ConversationGuard):
    """Given to the span agent's guard as its conversation scope: it keeps the records of the
    calls of agents whose policy turns the scope on, and their usage where it sets a
    conversation budget, for the span agent to send, and decides nothing (the conversation
    agent does, from the topic)."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        # Usage is sent only against a conversation budget (see observe_usage): without one
        # anywhere, the guard hands none.
        self.counts_usage = any(entry.counts_conversation_usage for entry in policy.entries)
        self.records: list[Record] = []
        self.sources: list[Any] = []  # aligned with `records`: the message each came from

    def observe_call(self, record: ConversationCall) -> Decision | None:
        if self._policy(record.service, record.agent_name).conversation_enabled:
            self.records.append(record)
        return None

    def observe_usage(self, record: ConversationUsage) -> Decision | None:
        # Usage matters to the conversation only against one of its budgets: without one
        # (the scope's default) it is not sent, which spares both agents most of the records
        # (usage spans outnumber tool calls). A budget set later counts from then.
        if self._policy(record.service, record.agent_name).counts_conversation_usage:
            self.records.append(record)
        return None

    def retract(self, decision: Decision) -> None:
        """Nothing to undo: the trace side takes no conversation decision."""

    def sourced(self, message: Any) -> None:
        """The records since the last call came from `message`."""
        self.sources.extend([message] * (len(self.records) - len(self.sources)))

    def drain(self) -> tuple[list[Record], list[Any]]:
        """The records and the message each came from, in order."""
        self.sourced(None)  # records of no message (a direct caller): no source
        taken = self.records, self.sources
        self.records, self.sources = [], []
        return taken


def conversation_partition(conversation_id: str, partitions: int) -> int:
    """The partition of the conversation topic a conversation's records go to: the one a
    record keyed by its id goes to under the Java client's default partitioner (murmur2, as
    aiokafka's), where version 1 records of the same conversation went."""
    return (murmur2(conversation_id.encode()) & 0x7FFFFFFF) % partitions


# murmur2 is pure Python, and each span batch names the same few hundred conversations again
# (as collector_partition is cached for trace ids).
_partition_of = lru_cache(maxsize=16_384)(conversation_partition)


def _row(record: Record) -> list[Any]:
    if isinstance(record, ConversationCall):
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


def encode_packs(
    records: Iterable[Record], partitions: int, limit: int = MAX_RECORD_BYTES
) -> list[Pack]:
    """The records as packs, one per partition of the conversation topic (more when one
    would pass `limit` bytes): each holds the calls and usage of the conversations whose
    partition it is, each conversation's in order, as
    `{"v": 2, "c": {conversation id: [row, ...], ...}}`."""
    # partition -> conversation id -> rows; dicts keep each conversation's first appearance.
    by_partition: dict[int, dict[str, list[list[Any]]]] = {}
    for record in records:
        conversation_id = record.conversation_id
        partition = _partition_of(conversation_id, partitions)
        conversations = by_partition.get(partition)
        if conversations is None:
            conversations = by_partition[partition] = {}
        rows = conversations.get(conversation_id)
        if rows is None:
            rows = conversations[conversation_id] = []
        rows.append(_row(record))
    packs: list[Pack] = []
    for partition, conversations in by_partition.items():
        # One encoding of the whole pack; split by conversation only when it is too large.
        value = compact_json.dumps({"v": PACKED_VERSION, "c": conversations})
        if len(value) <= limit:
            packs.append(_pack(partition, list(conversations), value))
            continue
        chunk: list[tuple[str, bytes]] = []
        size = 0
        for conversation_id, rows in conversations.items():
            entry = compact_json.dumps({conversation_id: rows})[1:-1]
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


def _text(value: Any, what: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_FIELD_CHARS:
        raise ValueError(f"{what} is not a string of 1-{MAX_FIELD_CHARS} characters")
    return value


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} is not a non-negative integer")
    return value


def decode_records(key: bytes | None, value: bytes | None) -> list[Record]:
    """The records of one message of the conversation topic, a pack (version 2) or one
    conversation's (version 1, its id in the key); ValueError says what is wrong."""
    try:
        body = compact_json.loads(value or b"")
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not a conversation record: {exc}") from None
    version = body.get("v") if isinstance(body, dict) else None
    if version == PACKED_VERSION:
        conversations = body.get("c")
        if not isinstance(conversations, dict):
            raise ValueError("no conversation map")
        records: list[Record] = []
        for conversation_id, rows in conversations.items():
            records += _decode_rows(_text(conversation_id, "conversation id"), rows)
        return records
    if version != RECORD_VERSION:
        raise ValueError(f"not a version {PACKED_VERSION} or {RECORD_VERSION} conversation record")
    if not key:
        raise ValueError("no conversation id in the key")
    try:
        conversation_id = key.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"not a conversation record: {exc}") from None
    return _decode_rows(_text(conversation_id, "conversation id"), body.get("r"))


def _decode_rows(conversation_id: str, rows: Any) -> list[Record]:
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
            span_id = _span_id(span_hex)
            key = (tool, args_hash, result_hash)
            append(ConversationCall(conversation_id, trace_id, span_id, end, key, service, agent))
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
            span_id = _span_id(span_hex)
            append(
                ConversationUsage(
                    conversation_id, trace_id, span_id, end, tokens, cost, service, agent
                )
            )
        else:
            _check_row(row)
    return records


def _fine_text(value: Any) -> bool:
    return type(value) is str and 0 < len(value) <= MAX_FIELD_CHARS


def _fine_shared(trace_id: Any, span_hex: Any, end: Any, service: Any, agent: Any) -> bool:
    """The fields every row has, each of its type (the fast path's check)."""
    return (
        _fine_text(trace_id)
        and _fine_text(span_hex)
        and type(end) is int
        and end >= 0
        and _fine_text(service)
        and (agent is None or _fine_text(agent))
    )


def _span_id(span_hex: str) -> bytes:
    try:
        return bytes.fromhex(span_hex)
    except ValueError:
        raise ValueError("span id is not hex") from None


def _check_row(row: list[Any]) -> None:
    """Raise ValueError saying what is wrong with a row the fast path did not take."""
    if len(row) not in (8, 9) or row[0] not in ("c", "u"):
        raise ValueError("a record is not a call or usage row")
    _text(row[1], "trace id")
    try:
        bytes.fromhex(_text(row[2], "span id"))
    except ValueError:  # a span id that is no string says so too, as it always did
        raise ValueError("span id is not hex") from None
    _count(row[3], "end time")
    _text(row[-2], "service")
    _text(row[-1], "agent name", optional=True)
    if row[0] == "c" and len(row) == 9:
        _text(row[4], "tool name")
        _text(row[5], "arguments hash", optional=True)
        _text(row[6], "result hash", optional=True)
    elif row[0] == "u" and len(row) == 8:
        _count(row[4], "tokens")
        _count(row[5], "cost")
    else:
        raise ValueError(f"a {row[0]!r} record of {len(row)} fields")
    raise ValueError("a record field is not of its type")


# -- the conversation side: decide ---------------------------------------------------------


def conversation_view(
    table: MutableMapping[bytes, bytes], bucket_seconds: float = 60.0, cache_size: int = 0
) -> DecodedStates:
    """The conversation table as the scope reads it: ConversationStates, written once per
    commit interval, idle ones evicted with bounded work (streams/decoded_states.py)."""
    return DecodedStates(
        table,
        bucket_seconds=bucket_seconds,
        cache_size=cache_size,
        decode=ConversationState.from_bytes,
    )


class WorkerConversations(ConversationGuard):
    """The conversation scope over the worker's table: a record seen before (a span batch
    decided again after a crash sends its records again) is dropped by its span id."""

    def __init__(self, policy: Policy, states: DecodedStates, **kwargs: Any) -> None:
        super().__init__(policy, states=states, **kwargs)  # type: ignore[arg-type]
        self.duplicates = 0
        self._taken: tuple[str, Any] | None = None  # (conversation id, its state) being observed

    def observe(self, record: Record) -> Decision | None:
        conversation_id = record.conversation_id
        state = self.states.get(conversation_id)
        if state is not None and record.span_id in state.recent_span_ids:
            self.duplicates += 1
            return None
        # The state just read is the one the scope changes (`_state`): read once per record,
        # written once (`_store`), not read and written again around the scope's own turn.
        self._taken = (conversation_id, state)
        try:
            if isinstance(record, ConversationCall):
                return self.observe_call(record)
            return self.observe_usage(record)
        finally:
            self._taken = None

    def _state(self, conversation_id: str, service: str, agent_name: str | None) -> Any:
        taken = self._taken
        if taken is not None and taken[0] == conversation_id and taken[1] is not None:
            return taken[1]
        return super()._state(conversation_id, service, agent_name)

    def _store(self, record: Record, state: Any) -> None:
        recent = state.recent_span_ids
        recent[record.span_id] = None
        if len(recent) > MAX_RECENT_SPANS:
            del recent[next(iter(recent))]  # the oldest
        super()._store(record, state)


class ConversationAgent(ScopeAgent):
    """Reads the conversation topic in batches: decides each record and sends the decisions
    (acked by the broker) per batch; writes the changed conversation states once per commit
    interval and acks the messages once the changelog acked those writes, as the span agent
    does with the trace table (streams/write_back.py, ScopeAgent), under the same lease."""

    def __init__(
        self, worker: Worker, topic: faust.TopicT, states: DecodedStates, lease: Lease
    ) -> None:
        table = states.table
        assert isinstance(table, StateTable)  # its changelog writes are awaited before acks
        super().__init__(worker, states, table, lease)
        self.topic = topic
        self.outcomes = conversation_tally(worker)
        self.guard = WorkerConversations(worker.guard.policy, states, clock=worker.guard.clock)

    def attach(self, app: faust.App) -> None:
        self.attach_writes(app)
        app.agent(self.topic, name="guard-conversations")(self.guard_conversations)

    async def guard_conversations(self, stream: faust.StreamT) -> None:
        await self.run_batches(stream, 0.01, self.guard_batch)

    def decide(self, events: list[EventT]) -> list[Send]:
        outbox = self.worker.outbox
        sends: list[Send] = []
        read = duplicates = decided = 0
        for event in events:
            message = event.message
            try:
                records = decode_records(message.key, message.value)
            except ValueError as exc:
                sends.append(outbox.dead_letter(message, f"conversation record: {exc}"))
                continue
            read += len(records)
            decisions: list[Decision] = []
            before = self.guard.duplicates
            with event_context(event):
                for record in records:
                    decision = self.guard.observe(record)
                    if decision is not None:
                        decisions.append(decision)
            duplicates += self.guard.duplicates - before
            if decisions:
                decided += len(decisions)
                sends.extend(outbox.sends_for(Outcome(decisions=decisions), message))
        self.outcomes.add(ConversationCount.RECORDS_READ, read)
        self.outcomes.add(ConversationCount.DUPLICATES, duplicates)
        self.outcomes.add(ConversationCount.DECISIONS, decided)
        return sends

    def settle(self, sends: list[Send], failed: list[Send]) -> None:
        """A decision whose signals were not all sent is not decided: it can trip again. A
        kill sends two (its trace's, its conversation's): each decision is settled once."""
        lost = {id(send.decision) for send in failed if send.decision is not None}
        settled: set[int] = set()
        for send in sends:
            decision = send.decision
            if decision is None or id(decision) in settled:
                continue
            settled.add(id(decision))
            if id(decision) not in lost:
                self.worker.latency.signal_sent(decision)
                continue
            self.guard.retract(decision)
            self.worker.health.lost_signals += 1
            log.error(
                "conversation kill signal not sent; it can trip again",
                extra={
                    "conversation_id": decision.scope.conversation_id if decision.scope else None
                },
            )

    def evict_idle(self, events: list[EventT]) -> None:
        ttl = self.worker.settings.state_ttl
        cutoff = self.worker.guard.clock() - ttl
        evicted = self.states.evict_idle(events, cutoff, EVICT_PER_BATCH)
        if evicted:
            self.outcomes.add(ConversationCount.EVICTED, evicted)
            log.info("evicted idle conversations", extra={"evicted": evicted, "ttl": ttl})


def conversation_sends(worker: Worker, records: list[Record], sources: list[Any]) -> list[Send]:
    """The span agent's records for the conversation topic, packed one per partition (a Kafka
    record each costs both agents), each conversation's in order; a pack that cannot be
    written leaves a dead letter pointing at the first message that contributed to it
    (`sources` is aligned with `records`)."""
    topic = worker.conversations_out
    assert topic is not None
    # Each conversation's first record with a source, by its place in the batch (a record of
    # no message, a direct caller's, points nowhere).
    first_source: dict[str, tuple[int, Any]] = {}
    for index, (record, source) in enumerate(zip(records, sources, strict=True)):
        if source is not None:
            first_source.setdefault(record.conversation_id, (index, source))
    sends = []
    for pack in encode_packs(records, worker.settings.scope_partitions):
        found = [first_source[c] for c in pack.conversations if c in first_source]
        source = min(found, key=lambda first: first[0])[1] if found else None
        kwargs = {"key": pack.key, "value": pack.value, "partition": pack.partition}
        sends.append(Send(topic, kwargs, source=source, deferred=True))
    return sends
