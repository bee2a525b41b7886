"""The span agent: batches of OTLP messages through the guard, their sends acked before commit.

A message counts as done (acked, so committable) once its batch's sends are acked by the broker
and the states it changed are written. States are written once per commit interval, not per
batch (docs/design.md, "State writes once per commit"): each message holds one more reference
until that flush, so Faust commits no offset past a state not yet written.
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
from spanguard.streams.conversations import (
    ConversationCount,
    conversation_sends,
    conversation_tally,
)
from spanguard.streams.delivery import Send, send_all
from spanguard.streams.state import event_context

if TYPE_CHECKING:
    from spanguard.streams.wiring import Worker

__all__ = ["EVICT_PER_BATCH", "FLUSH_CHECK_INTERVAL", "SpanAgent", "SpanCount"]

log = logging.getLogger("spanguard.worker")

# Idle traces deleted per batch at most: eviction never stalls the event loop.
EVICT_PER_BATCH = 256
# Seconds between two looks of the flush timer (a due flush waits at most this long when idle).
FLUSH_CHECK_INTERVAL = 0.1


class SpanCount(CountedOutcome):
    """What the span agent counts of its own."""

    # Records whose send failed, dead-lettered as pointers to the message they came from.
    DEAD_LETTERS = "dead_letters"


class SpanAgent:
    """The span agent and what it keeps between batches: the messages held until their states
    are written, where it got to in each partition, and a failure that blocks every later
    batch. `attach` registers it, its timers and its hooks with the Faust app."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.outcomes = Tally()
        worker.counted[SpanCount] = self.outcomes
        self.conversation_records = conversation_tally(worker)
        # Where the agent got to in each source partition: the offset after the last message
        # of a completed batch, or the first one of a batch still running. Records between it
        # and the partition's highwater are waiting on the agent (health: stuck while lag grows).
        self.reached: dict[TP, int] = {}
        # Events whose changed states are not written yet: each holds its message's ack.
        self.held: list[EventT] = []
        self.flushed_at = time.monotonic()
        self.in_batch = False
        self.draining = False  # Faust waits for every message to be acked: flush at once
        # A failure (a batch that raised, a flush that failed) left messages that can never be
        # acked, so no offset after them would be committed: every batch after it fails too,
        # loudly, until the restart decides them again (health: crashed, then /livez red).
        self.unackable: BaseException | None = None
        settings = worker.settings
        self.verify_goals = worker.verifier is not None and worker.verifier.wanted
        # Packed records of the repartition topic are decided on the partition they were read from.
        self.repartition_topic = settings.repartition_topic

    def attach(self, app: faust.App) -> None:
        app.timer(interval=FLUSH_CHECK_INTERVAL)(self.flush_when_idle)
        app.timer(interval=1.0)(self.watch_progress)
        app.on_partitions_revoked.connect(self.forget_positions)
        # A rebalance and a stop both wait, in App._consumer_wait_empty, until every message
        # taken is acked, with timers already stopped on a stop: the held messages are flushed
        # first (a batch still running flushes as it ends), so neither waits out the interval
        # or forever.
        app._consumer_wait_empty = self._flushing_first(app._consumer_wait_empty)  # type: ignore[method-assign]
        app.agent(self.worker.spans_in, name="guard-spans")(self.guard_spans)

    # -- writing states, then acking -------------------------------------------------------

    def flush_states(self) -> None:
        """Write the states changed since the last flush, then let their messages be acked."""
        self.worker.states.flush()
        self.flushed_at = time.monotonic()
        released = self.held.copy()
        self.held.clear()
        for event in released:
            event.ack()  # our reference; the take buffer acked its own after the batch

    def flush_due(self) -> bool:
        due = time.monotonic() - self.flushed_at >= self.worker.settings.commit_interval
        return bool(self.held) and (due or self.draining)

    def flush_between_batches(self) -> None:
        try:
            self.flush_states()
        except Exception as exc:
            log.exception("states not written; their messages stay unacked until a restart")
            self.unackable = exc
            self.give_up(exc)

    def give_up(self, exc: BaseException) -> None:
        """Nothing since the last flush is written or acked: decided again on restart."""
        self.worker.states.discard()
        self.held.clear()
        self.worker.health.crashed(exc)

    async def flush_when_idle(self) -> None:
        # Between batches only: a batch's retractions write to states it has open.
        if not self.in_batch and self.flush_due():
            self.flush_between_batches()

    def _flushing_first(
        self, wait_empty: Callable[..., Awaitable[None]]
    ) -> Callable[..., Awaitable[None]]:
        async def flush_then_wait_empty(*args: Any, **kwargs: Any) -> None:
            self.draining = True
            try:
                if not self.in_batch and self.held:
                    self.flush_between_batches()
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
                try:
                    await self.guard_batch(events)
                finally:
                    self.in_batch = False
                self.worker.health.progressed()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                crashed = True
                self.unackable = self.unackable or exc
                self.give_up(exc)
            raise
        finally:
            if self.held and not crashed:  # stopping: what was decided is written and acked
                try:
                    self.flush_states()
                except Exception as exc:  # not committed: decided again after the restart
                    log.warning("states not flushed on stop", extra={"error": repr(exc)})

    async def guard_batch(self, events: list[EventT]) -> None:
        if self.unackable is not None:
            raise RuntimeError(f"messages left unacked by an earlier failure: {self.unackable!r}")
        for event in events:
            self.reached.setdefault(event.message.tp, event.message.offset)
            event.message.incref()  # acked by flush_states, once its states are written
        self.held.extend(events)
        self.worker.states.begin_batch()
        sends, goal_sends = self.decide(events)
        failed = await send_all(sends)
        self.settle(sends, failed)
        await self.dead_letter_unsent(failed)
        if self.flush_due():
            self.flush_states()
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
            if self.verify_goals and outcome.has_root_span:
                goal = {"key": message.key, "value": message.value}
                goal_sends.append(Send(worker.goal_checks, goal, source=message))
        if worker.recorder is not None and worker.recorder.records:
            # One record per conversation and batch: a Kafka record each costs both agents.
            records, sources = worker.recorder.drain()
            self.conversation_records.add(ConversationCount.RECORDS_SENT, len(records))
            sends.extend(conversation_sends(worker, records, sources))
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
