"""The span agent: batches of OTLP messages through the guard, their sends acked before commit.

A message counts as done (acked, so committable) once its batch's sends are acked by the broker
and the states it changed are written and their changelog records acked. States are written once
per commit interval, not per batch (docs/design.md, "State writes once per commit"): each message
holds one more reference until that flush, so Faust commits no offset past a state not yet in
the changelog. A worker whose lease on its partitions lapsed (streams/fence.py) neither decides,
sends, writes nor acks until a heartbeat renews it; fenced, it drops all of that unwritten.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import faust
from faust.types import TP, EventT

from spanguard.outcomes import CountedOutcome, Tally
from spanguard.streams.agent_windows import (
    AgentWindowCount,
    agent_usage_sends,
    agent_window_tally,
)
from spanguard.streams.conversations import (
    ConversationCount,
    conversation_sends,
    conversation_tally,
)
from spanguard.streams.delivery import Send, send_all
from spanguard.streams.fence import Lease
from spanguard.streams.state import event_context

if TYPE_CHECKING:
    from spanguard.streams.wiring import Worker

__all__ = [
    "CHANGELOG_ACK_TIMEOUT",
    "EVICT_PER_BATCH",
    "FLUSH_CHECK_INTERVAL",
    "SpanAgent",
    "SpanCount",
]

log = logging.getLogger("spanguard.worker")

# Idle traces deleted per batch at most: eviction never stalls the event loop.
EVICT_PER_BATCH = 256
# Seconds between two looks of the flush timer (a due flush waits at most this long when idle).
FLUSH_CHECK_INTERVAL = 0.1
# Seconds a flush waits for its changelog acks on a stop, before leaving them unacked (decided
# again after the restart); running, it waits as long as the lease holds.
CHANGELOG_ACK_TIMEOUT = 10.0


class SpanCount(CountedOutcome):
    """What the span agent counts of its own."""

    # Records whose send failed, dead-lettered as pointers to the message they came from.
    DEAD_LETTERS = "dead_letters"


class SpanAgent:
    """The span agent and what it keeps between batches: the messages held until their states
    are written, where it got to in each partition, a failure that blocks every later batch,
    and its lease on the partitions. `attach` registers it, its timers and its hooks with the
    Faust app."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.outcomes = Tally()
        worker.counted[SpanCount] = self.outcomes
        self.conversation_records = conversation_tally(worker)
        self.agent_usage_records = agent_window_tally(worker)
        # Where the agent got to in each source partition: the offset after the last message
        # of a completed batch, or the first one of a batch still running. Records between it
        # and the partition's highwater are waiting on the agent (health: stuck while lag grows).
        self.reached: dict[TP, int] = {}
        # Events whose changed states are not written yet: each holds its message's ack.
        self.held: list[EventT] = []
        # Events whose states are written, waiting for the changelog's acks (one list per flush).
        self.confirming: list[list[EventT]] = []
        self.flushed_at = time.monotonic()
        self.in_batch = False
        self.draining = False  # Faust waits for every message to be acked: flush at once
        # A failure (a batch that raised, a flush that failed) left messages that can never be
        # acked, so no offset after them would be committed: every batch after it fails too,
        # loudly, until the restart decides them again (health: crashed, then /livez red).
        self.unackable: BaseException | None = None
        settings = worker.settings
        self.lease = Lease(settings.session_timeout)
        self.verify_goals = worker.verifier is not None and worker.verifier.wanted
        # Packed records of the repartition topic are decided on the partition they were read from.
        self.repartition_topic = settings.repartition_topic

    def attach(self, app: faust.App) -> None:
        app.timer(interval=FLUSH_CHECK_INTERVAL)(self.flush_when_idle)
        app.timer(interval=1.0)(self.watch_progress)
        app.on_partitions_revoked.connect(self.forget_positions)
        # The lease starts with the rebalance that assigns the partitions, and is renewed by
        # each heartbeat answered after (the consumer's thread calls both).
        app.on_rebalance_start = self._noting_rebalance_start(app.on_rebalance_start)  # type: ignore[method-assign]
        app.on_partitions_assigned.connect(self.hold_lease)
        # A rebalance and a stop both wait, in App._consumer_wait_empty, until every message
        # taken is acked, with timers already stopped on a stop: the held messages are flushed
        # first (a batch still running flushes as it ends), so neither waits out the interval
        # or forever. A worker whose lease lapsed writes nothing more: the partitions may be
        # another's already.
        app._consumer_wait_empty = self._flushing_first(app._consumer_wait_empty)  # type: ignore[method-assign]
        app.agent(self.worker.spans_in, name="guard-spans")(self.guard_spans)

    # -- writing states, then acking -------------------------------------------------------

    async def flush_states(self, ack_timeout: float | None = None) -> None:
        """Write the states changed since the last flush and, once the changelog has acked
        them, let their messages be acked: no offset is committed ahead of its state."""
        epoch = self.lease.epoch
        self.worker.states.flush()
        self.flushed_at = time.monotonic()
        written = self.held.copy()
        self.held.clear()
        self.confirming.append(written)
        try:
            writes = self.worker.table.take_unconfirmed()
            if not await self.changelog_acked(writes, epoch, ack_timeout):
                return  # fenced meanwhile (the revocation released them) or stopping
        finally:
            self.confirming = [batch for batch in self.confirming if batch is not written]
        for event in written:
            event.ack()  # our reference; the take buffer acked its own after the batch

    async def changelog_acked(
        self, writes: list[Awaitable[Any]], epoch: int, timeout: float | None
    ) -> bool:
        """Wait for the broker's acks of `writes`; False if fenced or out of time first. A
        refused write raises: its messages can never be acked."""
        pending = {asyncio.ensure_future(write) for write in writes}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            if epoch != self.lease.epoch:
                return False
            if deadline is not None and time.monotonic() >= deadline:
                log.warning("changelog not acked in time; its messages stay unacked")
                return False
            done, pending = await asyncio.wait(pending, timeout=FLUSH_CHECK_INTERVAL)
            for write in done:
                write.result()
        return epoch == self.lease.epoch

    def flush_due(self) -> bool:
        due = time.monotonic() - self.flushed_at >= self.worker.settings.commit_interval
        return bool(self.held) and (due or self.draining)

    async def flush_between_batches(self) -> None:
        try:
            await self.flush_states()
        except Exception as exc:
            log.exception("states not written; their messages stay unacked until a restart")
            self.unackable = exc
            self.give_up(exc)

    def give_up(self, exc: BaseException) -> None:
        """Nothing since the last flush is written or acked: decided again on restart."""
        self.discard_unwritten()
        self.worker.health.crashed(exc)

    def discard_unwritten(self) -> None:
        self.worker.states.discard()
        self.held.clear()

    async def flush_when_idle(self) -> None:
        # Between batches only: a batch's retractions write to states it has open. Not on a
        # lapsed lease: the flush waits for the renewal, or is dropped by the fence.
        if not self.in_batch and self.flush_due() and self.lease.held():
            await self.flush_between_batches()

    async def flush_on_stop(self) -> None:
        """Stopping: what was decided is written, its changelog acks awaited a bounded time."""
        try:
            await self.flush_states(ack_timeout=CHANGELOG_ACK_TIMEOUT)
        except Exception as exc:  # not committed: decided again after the restart
            log.warning("states not flushed on stop", extra={"error": repr(exc)})

    # -- the lease -------------------------------------------------------------------------

    def drop_unwritten(self) -> None:
        """Fenced: what was decided since the last flush is not written and its messages are
        not acked (nor left for Faust to wait on): the next owner decides them again from the
        committed offsets and the changelog."""
        states = self.worker.states
        states.discard()
        # The partitions may come back in the next generation without Faust calling them
        # revoked: what this worker cached and indexed of them may be stale by then.
        states.revoke_all()
        self.release(self.held + [event for written in self.confirming for event in written])

    def release(self, events: list[EventT]) -> None:
        """Let go of `events` unacked: Faust stops waiting on them and commits none of them."""
        dropped = {id(event) for event in events}
        self.held = [event for event in self.held if id(event) not in dropped]
        unacked = self.worker.app.consumer._unacked_messages  # Faust waits on these to rebalance
        waited_on = [event for event in events if event.message in unacked]
        for event in waited_on:
            unacked.discard(event.message)
        if waited_on:  # counted once: a batch dropped by the revocation is released again
            log.warning("fenced messages dropped", extra={"messages": len(waited_on)})

    def _noting_rebalance_start(self, rebalance_start: Callable[[], None]) -> Callable[[], None]:
        def note_rebalance_start() -> None:
            self.lease.rebalance_began()
            rebalance_start()

        return note_rebalance_start

    async def hold_lease(self, _: Any, assigned: set[TP], **__: Any) -> None:
        self.lease.assigned(self.worker.app.consumer._thread._consumer._coordinator)

    def _flushing_first(
        self, wait_empty: Callable[..., Awaitable[None]]
    ) -> Callable[..., Awaitable[None]]:
        async def flush_then_wait_empty(*args: Any, **kwargs: Any) -> None:
            if self.lease.fence_if_lapsed():
                self.drop_unwritten()
            self.draining = True
            try:
                if not self.in_batch and self.held and self.lease.held():
                    await self.flush_between_batches()
                await wait_empty(*args, **kwargs)
            finally:
                self.draining = False

        return flush_then_wait_empty

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
        except Exception:  # no consumer yet (starting, rebalancing): nothing to say this tick
            return
        self.worker.health.observe_pending(pending)

    # -- the agent -------------------------------------------------------------------------

    async def guard_spans(self, stream: faust.StreamT) -> None:
        # Messages come in small batches: a batch's events are acknowledged (and later
        # committed) only after its signals are acked by the broker and the states it changed
        # are written, once per commit interval (flush_states).
        crashed = False
        try:
            async for events in stream.take_events(self.worker.settings.batch_size, within=0.002):
                self.in_batch = True
                await self.guard_batch(events)
                self.in_batch = False
                self.worker.health.progressed()
        except BaseException as exc:
            crashed = self.stopped_mid_batch(exc)
            raise
        finally:
            if self.held and not crashed and self.lease.held():
                await self.flush_on_stop()

    def stopped_mid_batch(self, exc: BaseException) -> bool:
        """Stopped or failed, maybe mid-batch with kills not yet acked: that batch's states
        (fired marks among them) are not written, decided again on restart. True if failed."""
        cut_short, self.in_batch = self.in_batch, False
        crashed = not isinstance(exc, asyncio.CancelledError)
        if crashed:
            self.unackable = self.unackable or exc
            self.give_up(exc)
        elif cut_short:
            self.discard_unwritten()
        return crashed

    async def guard_batch(self, events: list[EventT]) -> None:
        if self.unackable is not None:
            raise RuntimeError(f"messages left unacked by an earlier failure: {self.unackable!r}")
        epoch = self.lease.epoch
        for event in events:
            self.reached.setdefault(event.message.tp, event.message.offset)
            event.message.incref()  # acked by flush_states, once its states are written
        self.held.extend(events)
        # Decide only what was fetched under a lease that holds (a frozen worker wakes with it
        # lapsed): fenced while waiting, the batch is dropped, released by the revocation.
        if not await self.lease.wait(epoch):
            self.release(events)
            return
        self.worker.states.begin_batch()
        sends, goal_sends = self.decide(events)
        failed = await send_all(sends)
        if epoch != self.lease.epoch:
            return  # fenced while sending: what it decided is dropped unwritten
        self.settle(sends, failed)
        await self.dead_letter_unsent(failed)
        if self.flush_due():
            if not await self.lease.wait(epoch):
                return  # fenced: nothing of it written
            await self.flush_states()
        if self.lease.holds(epoch):  # eviction deletes from the changelog: only under the lease
            self.evict_idle(events)
        if goal_sends:
            await self.dead_letter_unsent(await send_all(goal_sends))
        for event in events:
            self.reached[event.message.tp] = event.message.offset + 1

    def decide(self, events: list[EventT]) -> tuple[list[Send], list[Send]]:
        """What the batch's messages send: signals and records, and the goal checks."""
        worker = self.worker
        sends: list[Send] = []
        goal_sends: list[Send] = []
        for event in events:
            message = event.message
            with event_context(event):
                repartitioned = (
                    message.partition if message.topic == self.repartition_topic else None
                )
                outcome = worker.pipeline.handle(message.key, message.value, repartitioned)
            sends.extend(worker.outbox.sends_for(outcome, message))
            if worker.recorder is not None:
                worker.recorder.sourced(message)
            if worker.usage_recorder is not None:
                worker.usage_recorder.sourced(message)
            if self.verify_goals and outcome.has_root_span:
                goal = {"key": message.key, "value": message.value}
                goal_sends.append(Send(worker.goal_checks, goal, source=message))
        if worker.recorder is not None and worker.recorder.records:
            # One record per conversation and batch: a Kafka record each costs both agents.
            records, sources = worker.recorder.drain()
            self.conversation_records.add(ConversationCount.RECORDS_SENT, len(records))
            sends.extend(conversation_sends(worker, records, sources))
        if worker.usage_recorder is not None and worker.usage_recorder.records:
            # One record per agent and batch, each row naming the message it came from.
            usage, usage_sources = worker.usage_recorder.drain()
            self.agent_usage_records.add(AgentWindowCount.RECORDS_SENT, len(usage))
            sends.extend(agent_usage_sends(worker, usage, usage_sources))
        return sends, goal_sends

    def settle(self, sends: list[Send], failed: list[Send]) -> None:
        """Signals acked are sent (latency observed); a decision whose signal was not sent is
        not decided: the trace can trip again on its next call."""
        worker = self.worker
        lost = {id(send) for send in failed}
        for send in sends:
            if send.decision is not None and id(send) not in lost:
                worker.latency.signal_sent(send.decision)  # acked by the broker: sent
        for send in failed:
            if send.decision is not None:
                worker.guard.retract(send.decision)
                worker.health.lost_signals += 1
                log.error(
                    "kill signal not sent; the trace can trip again",
                    extra={"trace_id": send.decision.trace_id},
                )

    async def dead_letter_unsent(self, failed: list[Send]) -> None:
        pointers = self.worker.outbox.pointers_to_unsent(failed)
        self.outcomes.add(SpanCount.DEAD_LETTERS, len(pointers))
        for send in await send_all(pointers):
            log.error("dead letter not written", extra={"key": repr(send.kwargs.get("key"))})

    def evict_idle(self, events: list[EventT]) -> None:
        worker, ttl = self.worker, self.worker.settings.state_ttl
        evicted = worker.states.evict_idle(events, worker.guard.clock() - ttl, EVICT_PER_BATCH)
        if evicted:
            log.info("evicted idle traces", extra={"evicted": evicted, "ttl": ttl})
