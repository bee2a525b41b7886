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
from typing import Any

import faust

from spanguard.streams.delivery import Send, send_all
from spanguard.streams.state import event_context
from spanguard.streams.wiring import Worker

__all__ = ["EVICT_PER_BATCH", "FLUSH_CHECK_INTERVAL", "register"]

log = logging.getLogger("spanguard.worker")

# Idle traces deleted per batch at most: eviction never stalls the event loop.
EVICT_PER_BATCH = 256
# Seconds between two looks of the flush timer (a due flush waits at most this long when idle).
FLUSH_CHECK_INTERVAL = 0.1


def register(worker: Worker) -> None:
    app, settings, states = worker.app, worker.settings, worker.states
    guard, health, outbox = worker.guard, worker.health, worker.outbox
    verify_goals = worker.verifier is not None and worker.verifier.wanted
    # Packed records of the repartition topic are decided on the partition they were read from.
    repartition_topic = settings.repartition_topic
    # Where the span agent got to in each source partition: the offset after the last message
    # of a completed batch, or the first one of a batch still running. Records between it and
    # the partition's highwater are waiting on the agent (health: stuck while lag grows).
    reached: dict[Any, int] = {}
    # Events whose changed states are not written yet: each holds its message's ack.
    held: list[Any] = []
    flushed_at = time.monotonic()
    in_batch = False
    # A failure (a batch that raised, a flush that failed) left messages that can never be
    # acked, so no offset after them would be committed: every batch after it fails too,
    # loudly, until the restart decides them again (health: crashed, then /livez red).
    unackable: BaseException | None = None

    def flush_states() -> None:
        """Write the states changed since the last flush, then let their messages be acked."""
        nonlocal flushed_at
        states.flush()
        flushed_at = time.monotonic()
        released = held.copy()
        held.clear()
        for event in released:
            event.ack()  # our reference; the take buffer acked its own after the batch

    draining = False  # Faust waits for every message to be acked: flush at once

    def flush_due() -> bool:
        due = time.monotonic() - flushed_at >= settings.commit_interval
        return bool(held) and (due or draining)

    def flush_between_batches() -> None:
        nonlocal unackable
        try:
            flush_states()
        except Exception as exc:
            log.exception("states not written; their messages stay unacked until a restart")
            unackable = exc
            states.discard()
            held.clear()
            health.crashed(exc)

    @app.timer(interval=FLUSH_CHECK_INTERVAL)
    async def flush_when_idle() -> None:
        # Between batches only: a batch's retractions write to states it has open.
        if not in_batch and flush_due():
            flush_between_batches()

    # A rebalance and a stop both wait, in App._consumer_wait_empty, until every message taken
    # is acked, with timers already stopped on a stop: the held messages are flushed first (a
    # batch still running flushes as it ends), so neither waits out the interval or forever.
    wait_empty = app._consumer_wait_empty

    async def flush_then_wait_empty(*args: Any, **kwargs: Any) -> None:
        nonlocal draining
        draining = True
        try:
            if not in_batch and held:
                flush_between_batches()
            await wait_empty(*args, **kwargs)
        finally:
            draining = False

    app._consumer_wait_empty = flush_then_wait_empty  # type: ignore[method-assign]

    @app.on_partitions_revoked.connect
    async def forget_positions(_: Any, revoked: set[Any], **__: Any) -> None:
        reached.clear()  # a partition that comes back may have moved on elsewhere

    def pending_records() -> int:
        pending = 0
        for tp in app.consumer.assignment():
            if tp in reached:
                highwater = app.consumer.highwater(tp)
                if highwater is not None:
                    pending += max(0, highwater - reached[tp])
        return pending

    @app.timer(interval=1.0)
    async def watch_progress() -> None:
        try:
            pending = pending_records()
        except Exception:  # no consumer yet (starting, rebalancing): nothing to say this tick
            return
        health.observe_pending(pending)

    async def dead_letter_unsent(failed: list[Send]) -> None:
        pointers = outbox.pointers_to_unsent(failed)
        worker.pipeline.dead_letters += len(pointers)
        for send in await send_all(pointers):
            log.error("dead letter not written", extra={"key": repr(send.kwargs.get("key"))})

    @worker.app.agent(worker.spans_in, name="guard-spans")
    async def guard_spans(stream: faust.StreamT) -> None:
        # Messages come in small batches: a batch's events are acknowledged (and later
        # committed) only after its signals are acked by the broker and the states it changed
        # are written, once per commit interval (flush_states).
        nonlocal in_batch, unackable
        crashed = False
        try:
            async for events in stream.take_events(settings.batch_size, within=0.002):
                in_batch = True
                try:
                    await guard_batch(events)
                finally:
                    in_batch = False
                health.progressed()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                crashed = True
                # Nothing since the last flush is written or acked: decided again on restart.
                unackable = unackable or exc
                states.discard()
                held.clear()
                health.crashed(exc)
            raise
        finally:
            if held and not crashed:  # stopping: what was decided is written and acked
                try:
                    flush_states()
                except Exception as exc:  # not committed: decided again after the restart
                    log.warning("states not flushed on stop", extra={"error": repr(exc)})

    async def guard_batch(events: list[Any]) -> None:
        if unackable is not None:
            raise RuntimeError(f"messages left unacked by an earlier failure: {unackable!r}")
        for event in events:
            reached.setdefault(event.message.tp, event.message.offset)
            event.message.incref()  # acked by flush_states, once its states are written
        held.extend(events)
        states.begin_batch()
        sends: list[Send] = []
        goal_sends: list[Send] = []
        for event in events:
            message = event.message
            with event_context(event):
                repartitioned = message.partition if message.topic == repartition_topic else None
                outcome = worker.pipeline.handle(message.key, message.value, repartitioned)
            sends.extend(outbox.sends_for(outcome, message))
            if verify_goals and outcome.has_root_span:
                goal = {"key": message.key, "value": message.value}
                goal_sends.append(Send(worker.goal_checks, goal, source=message))
        failed = await send_all(sends)
        lost = {id(send) for send in failed}
        for send in sends:
            if send.decision is not None and id(send) not in lost:
                worker.latency.signal_sent(send.decision)  # acked by the broker: sent
        for send in failed:
            if send.decision is not None:
                # Not sent is not decided: the trace can trip again on its next call.
                guard.retract(send.decision)
                health.lost_signals += 1
                log.error(
                    "kill signal not sent; the trace can trip again",
                    extra={"trace_id": send.decision.trace_id},
                )
        await dead_letter_unsent(failed)
        if flush_due():
            flush_states()
        evicted = states.evict_idle(events, guard.clock() - settings.state_ttl, EVICT_PER_BATCH)
        if evicted:
            log.info("evicted idle traces", extra={"evicted": evicted, "ttl": settings.state_ttl})
        if goal_sends:
            await dead_letter_unsent(await send_all(goal_sends))
        for event in events:
            reached[event.message.tp] = event.message.offset + 1
