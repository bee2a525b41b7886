"""The span agent: batches of OTLP messages through the guard, their sends acked before commit.

A message counts as done (acked, so committable) once its batch's kill signals are acked by the
broker (within the batch), the records it sent that carry no decision (repartition and
conversation packs, agent usage) are acked too (awaited by the flush), and the states it changed
are written and their changelog records acked. States are written once per commit interval, not
per batch (docs/design.md, "State writes once per commit"): each message holds one more
reference until that flush, so Faust commits no offset past a state not yet in the changelog
(streams/write_back.py, WriteBack). A worker whose lease on its partitions lapsed
(streams/fence.py) neither decides, sends, writes nor acks until a heartbeat renews it; fenced,
it drops all of that unwritten.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import faust
from faust.types import TP, EventT

from spanguard.detection.pipeline import Outcome
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.schemas.decision import Decision
from spanguard.streams.agent_windows import (
    AgentWindowCount,
    agent_usage_sends,
)
from spanguard.streams.conversations import (
    ConversationCount,
    conversation_sends,
)
from spanguard.streams.delivery import Produced, Send, confirm, produce, send_all
from spanguard.streams.faust_internals import event_context, group_coordinator, wrap_rebalance_start
from spanguard.streams.fence import Lease
from spanguard.streams.scope import evict_idle_states, settle_signals
from spanguard.streams.tool_scope import ToolScopeCount, tool_call_sends
from spanguard.streams.write_back import WriteBack

if TYPE_CHECKING:
    from spanguard.streams.wiring import Worker

__all__ = ["HEADER_PACK", "SpanAgent", "SpanCount", "packed_partition"]

log = logging.getLogger("spanguard.worker")

# The header the Collector's spanguard_pack exporter (deploy/collector/packexporter) marks its
# records with: "PARTITION/PARTITIONS", where it wrote the record and the topic's count then.
HEADER_PACK = "spanguard-pack"


class SpanCount(CountedOutcome):
    """What the span agent counts of its own."""

    # Records whose send failed, dead-lettered as pointers to the message they came from.
    DEAD_LETTERS = "dead_letters"
    # The Collector's packed records (its spanguard_pack exporter): decided where they were
    # read, or split through the repartition topic because they were not where they claimed
    # to be or held traces of other partitions (a Collector or worker with another count).
    PACKS_DECIDED = "packs_decided"
    PACKS_REPARTITIONED = "packs_repartitioned"


class Decided(NamedTuple):
    """What a batch's messages send: the records still to produce, the goal checks, and what
    was handed to the producer as each message was decided (a decision's signals, a split
    message's packs), with their deliveries."""

    sends: list[Send]
    goal_sends: list[Send]
    signals: list[tuple[Send, Produced]]
    packs: list[tuple[Send, Produced]]


class SpanAgent:
    """The span agent and what it keeps between batches: the messages held until their states
    are written (`write_back`, whose hooks it is: the scope records it holds back, its dead
    letters), where it got to in each partition, and the worker's lease on its partitions.
    `attach` registers it, its timers and its hooks with the Faust app."""

    def __init__(self, worker: Worker, lease: Lease | None = None) -> None:
        self.worker = worker
        self.lease = Lease(worker.settings.session_timeout) if lease is None else lease
        self.write_back = WriteBack(worker, worker.states, worker.table, self.lease, hooks=self)
        self.outcomes = Tally()
        worker.counted[SpanCount] = self.outcomes
        self.conversation_records = worker.tally(ConversationCount)
        self.agent_usage_records = worker.tally(AgentWindowCount)
        self.tool_call_records = worker.tally(ToolScopeCount)
        # Where the agent got to in each source partition: the offset after the last message
        # of a completed batch, or the first one of a batch still running. Records between it
        # and the partition's highwater are waiting on the agent (health: stuck while lag grows).
        self.reached: dict[TP, int] = {}
        settings = worker.settings
        self.verify_goals = worker.verifier is not None and worker.verifier.wanted
        # Packed records of the repartition topic are decided on the partition they were read from.
        self.repartition_topic = settings.repartition_topic
        # The scopes' records are held `scope_hold` seconds from the first one held (or until
        # the next flush, which sends them first): one Kafka record per partition or agent for
        # many batches, where a batch of a quiet fleet is a message or two.
        self.scope_hold = settings.scope_hold
        self.holding_since: float | None = None

    def attach(self, app: faust.App) -> None:
        self.write_back.attach(app)
        app.timer(interval=1.0)(self.watch_progress)
        # (Faust types a receiver as taking any positional arguments; its signals send these.)
        app.on_partitions_revoked.connect(self.forget_positions)  # type: ignore[arg-type]
        # The lease starts with the rebalance that assigns the partitions, and is renewed by
        # each heartbeat answered after (the consumer's thread calls both).
        wrap_rebalance_start(app, self._noting_rebalance_start)
        app.on_partitions_assigned.connect(self.hold_lease)  # type: ignore[arg-type]
        app.agent(self.worker.spans_in, name="guard-spans")(self.guard_spans)

    # -- the lease -------------------------------------------------------------------------

    def _noting_rebalance_start(self, rebalance_start: Callable[[], None]) -> Callable[[], None]:
        def note_rebalance_start() -> None:
            self.lease.rebalance_began()
            rebalance_start()

        return note_rebalance_start

    async def hold_lease(self, _: Any, assigned: set[TP], **__: Any) -> None:
        self.lease.assigned(group_coordinator(self.worker.app))

    # -- progress --------------------------------------------------------------------------

    async def forget_positions(self, _: Any, revoked: set[TP], **__: Any) -> None:
        self.reached.clear()  # a partition that comes back may have moved on elsewhere

    def pending_records(self) -> int:
        consumer = self.worker.app.consumer
        pending = 0
        for tp in consumer.assignment():
            if tp in self.reached:
                highwater = consumer.highwater(tp)
                if highwater is not None:
                    pending += max(0, highwater - self.reached[tp])
        return pending

    async def watch_progress(self) -> None:
        try:
            pending = self.pending_records()
        # No consumer yet (starting, rebalancing): nothing to say this tick.
        except Exception:  # noqa: BLE001
            return
        self.worker.health.observe_pending(pending)

    # -- the agent -------------------------------------------------------------------------

    async def guard_spans(self, stream: faust.StreamT) -> None:
        # Messages come in small batches: a batch's events are acknowledged (and later
        # committed) only after its signals are acked by the broker and the states it changed
        # are written, once per commit interval (WriteBack.flush).
        await self.write_back.run_batches(
            stream, 0.002, self.guard_batch, self.worker.health.progressed
        )

    async def guard_batch(self, events: list[EventT]) -> None:
        write_back = self.write_back
        epoch = write_back.hold(events)
        for event in events:
            self.reached.setdefault(event.message.tp, event.message.offset)
        # Decide only what was fetched under a lease that holds (a frozen worker wakes with it
        # lapsed): fenced while waiting, the batch is dropped, released by the revocation.
        if not await self.lease.wait(epoch):
            write_back.release(events)
            return
        self.worker.states.begin_batch()
        sends, goal_sends, signals, packs = await self.decide(events)
        # Kill signals (and detections, dead letters) are acked within the batch; the records
        # that carry no decision are produced now and acked by the flush, before the messages
        # they came from (docs/design.md, "Records acked at the flush").
        urgent = [send for send in sends if not send.deferred]
        deferred = [send for send in sends if send.deferred]
        produced_urgent = await produce(urgent)  # first: no kill queues behind the packs
        produced_deferred = await produce(deferred)
        deferred[:0] = [send for send, _ in packs]
        produced_deferred[:0] = [produced for _, produced in packs]
        if self.records_due():
            await write_back.send_scope_records()
        urgent[:0] = [send for send, _ in signals]
        produced_urgent[:0] = [produced for _, produced in signals]
        failed = await confirm(urgent, produced_urgent)
        if epoch != self.lease.epoch:
            return  # fenced while sending: what it decided is dropped unwritten, unacked
        write_back.defer(deferred, produced_deferred)
        self.settle(urgent, failed)
        await self.dead_letter_unsent(failed)
        if write_back.flush_due() or write_back.flushing is not None:
            if not await self.lease.wait(epoch):
                return  # fenced: nothing of it written
            # The next batch (a kill in it, maybe) waits for neither the changelog's acks nor
            # more than a step of the states' writing: the rest is written a step after each
            # batch, or between batches.
            if write_back.flushing is not None:
                await write_back.write_step()
            else:
                await write_back.flush(acks_in_background=True, in_steps=True)
        if self.lease.holds(epoch):  # eviction deletes from the changelog: only under the lease
            self.evict_idle(events)
            await self.worker.table.send_pending()  # the tombstones, in order with the states
        if goal_sends:
            await self.dead_letter_unsent(await send_all(goal_sends))
        for event in events:
            self.reached[event.message.tp] = event.message.offset + 1

    def home_partition(self, message: Any) -> int | None:
        """The partition whose traces `message` claims to hold: a packed record of the
        repartition topic or of the Collector's packer, on the partition it was read from
        (the pipeline checks each trace); None for a message to split."""
        if message.topic == self.repartition_topic:
            return int(message.partition)
        claimed = packed_partition(message.headers)
        if claimed is None:
            return None
        if claimed == message.partition:
            return claimed
        self.outcomes.add(SpanCount.PACKS_REPARTITIONED)
        return None

    def count_pack(self, message: Any, home: int | None, outcome: Outcome) -> None:
        if home is None or message.topic == self.repartition_topic:
            return
        split = bool(outcome.repartition) or outcome.dead_letter is not None
        self.outcomes.add(SpanCount.PACKS_REPARTITIONED if split else SpanCount.PACKS_DECIDED)

    async def decide(self, events: list[EventT]) -> Decided:
        """What the batch's messages send. A decision's signals are handed to the producer as
        soon as it is made (a kill early in a long batch is on its way to the broker while the
        rest is decided; acked with the batch's), and so are a split message's packs."""
        worker = self.worker
        sends: list[Send] = []
        goal_sends: list[Send] = []
        signals: list[tuple[Send, Produced]] = []
        packs: list[tuple[Send, Produced]] = []
        for event in events:
            message = event.message
            with event_context(event):
                home = self.home_partition(message)
                outcome = worker.pipeline.handle(message.key, message.value, home)
            self.count_pack(message, home, outcome)
            message_sends = worker.outbox.sends_for(outcome, message)
            if outcome.decisions:  # its signals now, acked with the batch's
                sends.extend(await hand_over(message_sends, signals, deferred=False))
            elif outcome.repartition:  # its packs now, acked by the flush
                sends.extend(await hand_over(message_sends, packs, deferred=True))
            else:
                sends.extend(message_sends)
            if worker.recorder is not None:
                worker.recorder.sourced(message)
            if worker.usage_recorder is not None:
                worker.usage_recorder.sourced(message)
            if worker.tool_recorder is not None:
                worker.tool_recorder.hand_decisions(outcome.decisions)
                worker.tool_recorder.sourced(message)
            if self.verify_goals and outcome.has_root_span:
                goal = {"key": message.key, "value": message.value}
                goal_sends.append(Send(worker.goal_checks, goal, source=message))
        if self.holding_since is None and self.holds_records():
            self.holding_since = time.monotonic()
        return Decided(sends, goal_sends, signals, packs)

    # -- the scopes' records, held (its write-back's hooks) --------------------------------

    def holds_records(self) -> bool:
        worker = self.worker
        return bool(
            (worker.recorder is not None and worker.recorder.records)
            or (worker.usage_recorder is not None and worker.usage_recorder.records)
            or (worker.tool_recorder is not None and worker.tool_recorder.records)
        )

    def records_due(self) -> bool:
        held_since = self.holding_since
        return held_since is not None and time.monotonic() - held_since >= self.scope_hold

    def take_scope_records(self) -> list[Send]:
        """The calls and usage held for the scopes, as records: one per conversation
        partition and one per agent (a Kafka record each costs both agents), each row naming
        the message it came from."""
        worker = self.worker
        sends: list[Send] = []
        self.holding_since = None
        if worker.recorder is not None and worker.recorder.records:
            records, sources = worker.recorder.drain()
            self.conversation_records.add(ConversationCount.RECORDS_SENT, len(records))
            sends.extend(conversation_sends(worker, records, sources))
        if worker.usage_recorder is not None and worker.usage_recorder.records:
            usage, usage_sources = worker.usage_recorder.drain()
            self.agent_usage_records.add(AgentWindowCount.RECORDS_SENT, len(usage))
            sends.extend(agent_usage_sends(worker, usage, usage_sources))
        if worker.tool_recorder is not None and worker.tool_recorder.records:
            calls, call_sources = worker.tool_recorder.drain()
            self.tool_call_records.add(ToolScopeCount.RECORDS_SENT, len(calls))
            sends.extend(tool_call_sends(worker, calls, call_sources))
        return sends

    def drop_scope_records(self) -> None:
        worker = self.worker
        self.holding_since = None
        for recorder in (worker.recorder, worker.usage_recorder, worker.tool_recorder):
            if recorder is not None:
                recorder.drain()

    def settle(self, sends: list[Send], failed: list[Send]) -> None:
        """Signals acked are sent (latency observed); a decision whose signal was not sent is
        not decided: the trace can trip again on its next call."""
        settle_signals(self.worker, sends, failed, self.worker.guard.retract, _lost_signal)

    def count_dead_letters(self, pointers: int) -> None:
        self.outcomes.add(SpanCount.DEAD_LETTERS, pointers)

    async def dead_letter_unsent(self, failed: list[Send]) -> None:
        pointers = self.worker.outbox.pointers_to_unsent(failed)
        self.count_dead_letters(len(pointers))
        for send in await send_all(pointers):
            log.error("dead letter not written", extra={"key": repr(send.kwargs.get("key"))})

    def evict_idle(self, events: list[EventT]) -> None:
        worker, ttl = self.worker, self.worker.settings.state_ttl
        evict_idle_states(worker.states, events, worker.guard.clock() - ttl, "traces", ttl=ttl)


async def hand_over(
    sends: list[Send], handed: list[tuple[Send, Produced]], *, deferred: bool
) -> list[Send]:
    """Hand the `sends` whose `deferred` is as given to the producer now, each with its
    delivery appended to `handed`, and yield, so the producer's sender writes them while the
    batch goes on; return the others, produced with the batch's."""
    now = [send for send in sends if send.deferred == deferred]
    handed.extend(zip(now, await produce(now), strict=True))
    await asyncio.sleep(0)
    return [send for send in sends if send.deferred != deferred]


def _lost_signal(decision: Decision) -> tuple[str, dict[str, Any]]:
    return "kill signal not sent; the trace can trip again", {"trace_id": decision.trace_id}


def packed_partition(headers: Any) -> int | None:
    """The partition a packed record's HEADER_PACK names, or None (no such header, or one
    that does not read as PARTITION/PARTITIONS: such a record is split like any other)."""
    if not headers:
        return None
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    for name, value in pairs:
        if name != HEADER_PACK:
            continue
        try:
            partition, _, count = bytes(value).decode("ascii").partition("/")
            claimed, partitions = int(partition), int(count)
        except (TypeError, ValueError):
            return None
        return claimed if 0 <= claimed < partitions else None
    return None
