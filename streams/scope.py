"""What the worker's scopes beyond the trace share: the conversation scope
(streams/conversations.py), the agent windows (streams/agent_windows.py) and the tool scope
(streams/tool_scope.py).

A scope's traces land on every partition of the span topics (they are keyed by trace id), so in
the worker a scope is three parts, each a small subclass of a part written here once:

1. On the span agent's side, a `ScopeRecorder`: the trace guard hands it the scope's compact
   records through the kernel's sink protocol (spanguard/detection/scope.py), and the span agent
   sends them, deferred (acked at the state flush, before the messages they came from), to the
   scope's topic keyed by the scope's key. The wire records are schemas/scope_records.py's.
2. A table of the scope's states keyed the same way (`scope_view`): its changelog follows the
   partition a record arrives on, as the trace table's does.
3. A `ScopeRecordsAgent` (under streams/agents/) reading the topic in batches under the span
   agent's lease: each message decoded (a bad one dead-lettered with the reason), decided, its
   decisions sent and settled (`settle_signals`: a signal not sent is taken back), the states
   written once per commit interval and the messages acked once the changelog acked them
   (streams/write_back.py, ScopeAgent), idle states evicted with bounded work.

The tool scope, per tool across the fleet, is the third subclass of each: a recorder that sums
each counted call per message (`close_message`, as the agent usage recorder does), its rows in
schemas/scope_records.py, a view of its table, and an agent (a `ScopeRowsAgent`, as the agent
windows' is: a message is one key's rows) that names its counts, its guard (`make_guard`), its
`decode` and its `idle_window`; batching, deciding each message's rows, the lease, the flush
and ack rules, settling and eviction come with the bases.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import faust
from faust.types import EventT

from spanguard.detection.pipeline import Outcome
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.schemas.decision import Decision
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.delivery import Send
from spanguard.streams.faust_internals import event_context
from spanguard.streams.fence import Lease
from spanguard.streams.state_table import StateTable
from spanguard.streams.write_back import ScopeAgent

if TYPE_CHECKING:
    from spanguard.schemas.policy import Policy
    from spanguard.streams.wiring import Worker

__all__ = [
    "EVICT_PER_BATCH",
    "ScopeRecorder",
    "ScopeRecordsAgent",
    "ScopeRowsAgent",
    "evict_idle_states",
    "scope_view",
    "settle_signals",
]

log = logging.getLogger("spanguard.worker")

# Idle states deleted per batch at most (traces, conversations, agent windows): eviction never
# stalls the event loop.
EVICT_PER_BATCH = 256

RecordT = TypeVar("RecordT")
DecodedT = TypeVar("DecodedT")
KeyT = TypeVar("KeyT")
RowT = TypeVar("RowT")
KeyIn = TypeVar("KeyIn", contravariant=True)


class ScopeRecorder(Generic[RecordT]):
    """The span agent's side of a scope: the records the guard handed it since the last drain,
    and the message each came from, for the span agent to send. A subclass is the guard's sink
    for its scope (spanguard/detection/scope.py) and appends to `records`."""

    def __init__(self) -> None:
        self.records: list[RecordT] = []
        self.sources: list[Any] = []  # aligned with `records`: the message each came from

    def close_message(self) -> None:
        """Move what is held back for the current message (sums) to `records`."""

    def sourced(self, message: Any) -> None:
        """The records since the last call came from `message`."""
        self.close_message()
        self.sources.extend([message] * (len(self.records) - len(self.sources)))

    def drain(self) -> tuple[list[RecordT], list[Any]]:
        """The records and the message each came from, in order."""
        self.sourced(None)  # records of no message (a direct caller): no source
        taken = self.records, self.sources
        self.records, self.sources = [], []
        return taken


def scope_view(
    table: MutableMapping[bytes, bytes],
    decode: Callable[[bytes], Any],
    bucket_seconds: float = 60.0,
    cache_size: int = 0,
) -> DecodedStates:
    """A scope's table as its agent reads it: states decoded by `decode`, written once per
    commit interval, idle ones evicted with bounded work (streams/decoded_states.py)."""
    return DecodedStates(table, bucket_seconds=bucket_seconds, cache_size=cache_size, decode=decode)


def settle_signals(
    worker: Worker,
    sends: list[Send],
    failed: list[Send],
    retract: Callable[[Decision], None],
    lost: Callable[[Decision], tuple[str, dict[str, Any]]],
) -> None:
    """Signals acked are sent (latency observed); a decision whose signals were not all sent is
    not decided: `retract` takes it back, so it can trip again, and `lost` says what to log. A
    conversation kill sends two signals (its trace's, its conversation's): each decision is
    settled once."""
    lost_decisions = {id(send.decision) for send in failed if send.decision is not None}
    settled: set[int] = set()
    for send in sends:
        decision = send.decision
        if decision is None or id(decision) in settled:
            continue
        settled.add(id(decision))
        if id(decision) not in lost_decisions:
            worker.latency.signal_sent(decision)  # acked by the broker: sent
            continue
        retract(decision)
        worker.health.lost_signals += 1
        message, extra = lost(decision)
        log.error(message, extra=extra)


def evict_idle_states(
    states: DecodedStates, events: list[EventT], cutoff: float, what: str, **extra: Any
) -> int:
    """Delete the states of the batch's partitions last seen before `cutoff`, with bounded
    work; logged as "evicted idle `what`"."""
    evicted = states.evict_idle(events, cutoff, EVICT_PER_BATCH)
    if evicted:
        log.info(f"evicted idle {what}", extra={"evicted": evicted, **extra})
    return evicted


class ScopeRecordsAgent(ScopeAgent, Generic[DecodedT]):
    """Reads a scope's topic in batches: decides each message and sends the decisions (acked
    by the broker) per batch; writes the changed states once per commit interval and acks the
    messages once the changelog acked those writes, under the span agent's lease
    (streams/write_back.py, ScopeAgent).

    A subclass sets `agent_name` (the Faust agent's), `record_name` (a dead letter's reason
    names it), `states_name` (the eviction log's), `counts` with `evicted` (what it counts, in
    `outcomes`), makes its scope's guard (`make_guard`), says how long an idle state is kept
    (`idle_window`), and how a message is read (`decode`), decided (`decide_message`) and a
    decision taken back (`retract`, `lost_signal`)."""

    agent_name: str
    record_name: str
    states_name: str
    counts: type[CountedOutcome]
    evicted: CountedOutcome

    def __init__(
        self, worker: Worker, topic: faust.TopicT, states: DecodedStates, lease: Lease
    ) -> None:
        table = states.table
        assert isinstance(table, StateTable)  # its changelog writes are awaited before acks
        super().__init__(worker, states, table, lease)
        self.topic = topic
        self.outcomes: Tally = worker.tally(self.counts)
        self.guard = self.make_guard(worker, states)
        policy = worker.guard.policy
        self.idle_after = max(worker.settings.state_ttl, self.idle_window(policy))

    def make_guard(self, worker: Worker, states: DecodedStates) -> Any:
        """The scope's guard over its states (its type is the subclass's `guard`)."""
        raise NotImplementedError

    def idle_window(self, policy: Policy) -> float:
        """Seconds a state is kept without a record beyond the state TTL: a state idle a whole
        window is empty."""
        return 0.0

    def attach(self, app: faust.App) -> None:
        self.attach_writes(app)
        app.agent(self.topic, name=self.agent_name)(self.guard_records)

    async def guard_records(self, stream: faust.StreamT) -> None:
        await self.run_batches(stream, 0.01, self.guard_batch)

    def decode(self, key: bytes | None, value: bytes | None) -> DecodedT:
        """One message's records; ValueError says what is wrong."""
        raise NotImplementedError

    def decide_message(self, decoded: DecodedT) -> list[Decision]:
        """The decisions of one message's records (counted as the scope counts them)."""
        raise NotImplementedError

    def retract(self, decision: Decision) -> None:
        """Take back a decision whose signal was not sent."""
        raise NotImplementedError

    def lost_signal(self, decision: Decision) -> tuple[str, dict[str, Any]]:
        """What to log of a decision whose signal was not sent: the message and its extra."""
        raise NotImplementedError

    def decide(self, events: list[EventT]) -> list[Send]:
        outbox = self.worker.outbox
        sends: list[Send] = []
        for event in events:
            message = event.message
            try:
                decoded = self.decode(message.key, message.value)
            except ValueError as exc:
                sends.append(outbox.dead_letter(message, f"{self.record_name}: {exc}"))
                continue
            with event_context(event):
                decisions = self.decide_message(decoded)
            if decisions:
                sends.extend(outbox.sends_for(Outcome(decisions=decisions), message))
        return sends

    def settle(self, sends: list[Send], failed: list[Send]) -> None:
        settle_signals(self.worker, sends, failed, self.retract, self.lost_signal)

    def evict_idle(self, events: list[EventT]) -> None:
        cutoff = self.worker.guard.clock() - self.idle_after
        evicted = evict_idle_states(
            self.states, events, cutoff, self.states_name, ttl=self.idle_after
        )
        if evicted:
            self.outcomes.add(self.evicted, evicted)


class RowsGuard(Protocol[KeyIn, RowT]):
    """A scope's guard over windows of summed rows (the agent windows, the tool scope)."""

    def observe_rows(self, key: KeyIn, rows: list[RowT]) -> list[Decision]: ...

    def retract(self, decision: Decision) -> None: ...


class ScopeRowsAgent(ScopeRecordsAgent[tuple[KeyT, list[RowT]]]):
    """A scope agent whose messages are one key's summed rows (the agent windows, the tool
    scope): each message's rows counted into the key's window by `guard`, a decision whose
    signal was not sent taken back by it. A subclass sets `guard` and the outcomes counting
    the rows read (`rows_read`) and the decisions (`decided`)."""

    guard: RowsGuard[KeyT, RowT]
    rows_read: CountedOutcome
    decided: CountedOutcome

    def decide_message(self, decoded: tuple[KeyT, list[RowT]]) -> list[Decision]:
        key, rows = decoded
        self.outcomes.add(self.rows_read, len(rows))
        decisions = self.guard.observe_rows(key, rows)
        self.outcomes.add(self.decided, len(decisions))
        return decisions

    def retract(self, decision: Decision) -> None:
        self.guard.retract(decision)
