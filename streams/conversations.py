"""The conversation scope in the worker: a repartition of compact call records by conversation.

A conversation's traces land on different partitions (they are keyed by trace id), so the span
agent cannot decide across them. Instead its guard hands each counted call and usage change of
a trace that names a conversation to its recorder (`ConversationRecorder`), and the span agent
sends them, with the batch's other records, to the conversation topic keyed by conversation id.
The conversation agent (streams/agents/guard_conversations.py) reads that topic, keeps each
conversation's `ConversationState` in a table keyed by conversation id (its changelog follows
the partition a record arrives on, as the trace table's does), and sends its decisions down the
trace decisions' path: detections topic, signed kill signal, and from the detections topic
paging and the webhook. What the scopes share in the worker is streams/scope.py's.

The records (schemas/scope_records.py) hold ids, the call's key (tool name, hashes of its
arguments and result), its span id and end time, token and cost deltas; never arguments. One
Kafka record per partition of the conversation topic and span batch, holding the conversations
whose partition it is.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from aiokafka.partitioner import murmur2

from spanguard.detection.conversation import (
    ConversationCall,
    ConversationGuard,
    ConversationState,
    ConversationUsage,
)
from spanguard.detection.pipeline import MAX_RECORD_BYTES
from spanguard.detection.scope import policy_for
from spanguard.outcomes import CountedOutcome
from spanguard.schemas.decision import Decision
from spanguard.schemas.policy import Policy
from spanguard.schemas.scope_records import (
    Pack,
    call_row,
    decode_conversation_records,
    pack_rows,
    usage_row,
)
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.delivery import Send
from spanguard.streams.scope import ScopeRecorder, scope_view

if TYPE_CHECKING:
    from collections.abc import Iterable, MutableMapping

    from spanguard.streams.wiring import Worker

__all__ = [
    "MAX_RECENT_SPANS",
    "ConversationCount",
    "ConversationRecorder",
    "WorkerConversations",
    "conversation_partition",
    "conversation_sends",
    "conversation_view",
    "conversations_wanted",
    "decode_records",
    "encode_packs",
]

# Span ids a conversation remembers to drop records sent twice (a span batch decided again
# after a crash re-sends what it had sent): a commit interval's calls of one conversation.
MAX_RECENT_SPANS = 256

Record = ConversationCall | ConversationUsage


def conversations_wanted(policy: Policy) -> bool:
    """Whether any policy entry turns the conversation scope on: when none does, the worker
    builds none of it (no conversation keys read, no record sent)."""
    return policy.defaults.conversation.enabled or any(
        rule.policy.conversation.enabled for rule in policy.rules
    )


class ConversationCount(CountedOutcome):
    """What the conversation scope counts in the worker."""

    RECORDS_SENT = "conversation_records_sent"
    RECORDS_READ = "conversation_records_read"
    DUPLICATES = "conversation_duplicates"
    DECISIONS = "conversation_decisions"
    EVICTED = "conversations_evicted"


# -- the trace side: record, do not decide ----------------------------------------------------


class ConversationRecorder(ScopeRecorder[Record]):
    """The span agent's guard's conversation sink: it keeps the records of the calls of agents
    whose policy turns the scope on, and their usage where it sets a conversation budget, for
    the span agent to send (the conversation agent decides, from the topic)."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy
        # Usage is sent only against a conversation budget (see hand_usage): without one
        # anywhere, the guard hands none.
        self.counts_usage = any(entry.counts_conversation_usage for entry in policy.entries)

    def hand_call(self, record: ConversationCall) -> None:
        if policy_for(self.policy, record.service, record.agent_name).conversation.enabled:
            self.records.append(record)

    def hand_usage(self, record: ConversationUsage) -> None:
        # Usage matters to the conversation only against one of its budgets: without one
        # (the scope's default) it is not sent, which spares both agents most of the records
        # (usage spans outnumber tool calls). A budget set later counts from then.
        policy = policy_for(self.policy, record.service, record.agent_name)
        if policy.counts_conversation_usage:
            self.records.append(record)


def conversation_partition(conversation_id: str, partitions: int) -> int:
    """The partition of the conversation topic a conversation's records go to: the one a
    record keyed by its id goes to under the Java client's default partitioner (murmur2, as
    aiokafka's), where version 1 records of the same conversation went."""
    return (murmur2(conversation_id.encode()) & 0x7FFFFFFF) % partitions


# murmur2 is pure Python, and each span batch names the same few hundred conversations again
# (as collector_partition is cached for trace ids).
_partition_of = lru_cache(maxsize=16_384)(conversation_partition)


def encode_packs(
    records: Iterable[Record], partitions: int, limit: int = MAX_RECORD_BYTES
) -> list[Pack]:
    """The records as packs of the conversation topic (schemas/scope_records.py), one per
    partition (more when one would pass `limit` bytes), each conversation's in order."""
    rows = (
        (record.conversation_id, call_row(record))
        if isinstance(record, ConversationCall)
        else (record.conversation_id, usage_row(record))
        for record in records
    )
    return pack_rows(
        rows, lambda conversation_id: _partition_of(conversation_id, partitions), limit
    )


def decode_records(key: bytes | None, value: bytes | None) -> list[Record]:
    """The records of one message of the conversation topic; ValueError says what is wrong."""
    return decode_conversation_records(key, value, ConversationCall, ConversationUsage)


# -- the conversation side: decide ---------------------------------------------------------


def conversation_view(
    table: MutableMapping[bytes, bytes], bucket_seconds: float = 60.0, cache_size: int = 0
) -> DecodedStates:
    """The conversation table as the scope reads it: ConversationStates."""
    return scope_view(table, ConversationState.from_bytes, bucket_seconds, cache_size)


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
        if record.span_id not in recent:
            recent.add(record.span_id, MAX_RECENT_SPANS, slack=0)  # the oldest dropped
        super()._store(record, state)


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
