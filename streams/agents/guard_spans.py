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
from typing import Any

import faust

from spanguard.streams.delivery import Send, send_all
from spanguard.streams.fence import Lease
from spanguard.streams.state import event_context
from spanguard.streams.wiring import Worker

__all__ = ["CHANGELOG_ACK_TIMEOUT", "EVICT_PER_BATCH", "FLUSH_CHECK_INTERVAL", "register"]

log = logging.getLogger("spanguard.worker")

# Idle traces deleted per batch at most: eviction never stalls the event loop.
EVICT_PER_BATCH = 256
# Seconds between two looks of the flush timer (a due flush waits at most this long when idle).
FLUSH_CHECK_INTERVAL = 0.1
# Seconds a flush waits for its changelog acks on a stop, before leaving them unacked (decided
# again after the restart); running, it waits as long as the lease holds.
CHANGELOG_ACK_TIMEOUT = 10.0


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
    # Events whose states are written, waiting for the changelog's acks (one list per flush).
    confirming: list[list[Any]] = []
    flushed_at = time.monotonic()
    in_batch = False
    # A failure (a batch that raised, a flush that failed) left messages that can never be
    # acked, so no offset after them would be committed: every batch after it fails too,
    # loudly, until the restart decides them again (health: crashed, then /livez red).
    unackable: BaseException | None = None
    lease = Lease(settings.session_timeout)

    async def flush_states(ack_timeout: float | None = None) -> None:
        """Write the states changed since the last flush and, once the changelog has acked
        them, let their messages be acked: no offset is committed ahead of its state."""
        nonlocal flushed_at
        epoch = lease.epoch
        states.flush()
        flushed_at = time.monotonic()
        written = held.copy()
        held.clear()
        confirming.append(written)
        try:
            writes = worker.table.take_unconfirmed()
            if not await changelog_acked(writes, epoch, ack_timeout):
                return  # fenced meanwhile (the revocation released them) or stopping
        finally:
            confirming.remove(written)
        for event in written:
            event.ack()  # our reference; the take buffer acked its own after the batch

    async def changelog_acked(writes: list[Any], epoch: int, timeout: float | None) -> bool:
        """Wait for the broker's acks of `writes`; False if fenced or out of time first. A
        refused write raises: its messages can never be acked."""
        pending = {asyncio.ensure_future(write) for write in writes}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            if epoch != lease.epoch:
                return False
            if deadline is not None and time.monotonic() >= deadline:
                log.warning("changelog not acked in time; its messages stay unacked")
                return False
            done, pending = await asyncio.wait(pending, timeout=FLUSH_CHECK_INTERVAL)
            for write in done:
                write.result()
        return epoch == lease.epoch

    draining = False  # Faust waits for every message to be acked: flush at once

    def flush_due() -> bool:
        due = time.monotonic() - flushed_at >= settings.commit_interval
        return bool(held) and (due or draining)

    async def flush_between_batches() -> None:
        nonlocal unackable
        try:
            await flush_states()
        except Exception as exc:
            log.exception("states not written; their messages stay unacked until a restart")
            unackable = exc
            states.discard()
            held.clear()
            health.crashed(exc)

    @app.timer(interval=FLUSH_CHECK_INTERVAL)
    async def flush_when_idle() -> None:
        # Between batches only: a batch's retractions write to states it has open. Not on a
        # lapsed lease: the flush waits for the renewal, or is dropped by the fence.
        if not in_batch and flush_due() and lease.held():
            await flush_between_batches()

    def drop_unwritten() -> None:
        """Fenced: what was decided since the last flush is not written and its messages are
        not acked (nor left for Faust to wait on): the next owner decides them again from the
        committed offsets and the changelog."""
        states.discard()
        # The partitions may come back in the next generation without Faust calling them
        # revoked: what this worker cached and indexed of them may be stale by then.
        states.revoke_all()
        release(held + [event for written in confirming for event in written])

    def release(events: list[Any]) -> None:
        """Let go of `events` unacked: Faust stops waiting on them and commits none of them."""
        dropped = {id(event) for event in events}
        held[:] = [event for event in held if id(event) not in dropped]
        unacked = app.consumer._unacked_messages  # what Faust waits on before rebalancing
        for event in events:
            unacked.discard(event.message)
        if events:
            log.warning("fenced messages dropped", extra={"messages": len(events)})

    # A rebalance and a stop both wait, in App._consumer_wait_empty, until every message taken
    # is acked, with timers already stopped on a stop: the held messages are flushed first (a
    # batch still running flushes as it ends), so neither waits out the interval or forever.
    # A worker whose lease lapsed writes nothing more: the partitions may be another's already.
    wait_empty = app._consumer_wait_empty

    async def flush_then_wait_empty(*args: Any, **kwargs: Any) -> None:
        nonlocal draining
        if lease.fence_if_lapsed():
            drop_unwritten()
        draining = True
        try:
            if not in_batch and held and lease.held():
                await flush_between_batches()
            await wait_empty(*args, **kwargs)
        finally:
            draining = False

    app._consumer_wait_empty = flush_then_wait_empty  # type: ignore[method-assign]

    # The lease starts with the rebalance that assigns the partitions, and is renewed by each
    # heartbeat answered after (the consumer's thread calls both).
    rebalance_start = app.on_rebalance_start

    def note_rebalance_start() -> None:
        lease.rebalance_began()
        rebalance_start()

    app.on_rebalance_start = note_rebalance_start  # type: ignore[method-assign]

    @app.on_partitions_assigned.connect
    async def hold_lease(_: Any, assigned: set[Any], **__: Any) -> None:
        lease.assigned(app.consumer._thread._consumer._coordinator)

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
                await guard_batch(events)
                in_batch = False
                health.progressed()
        except BaseException as exc:
            # Stopped or failed mid-batch, maybe with kills not yet acked: the batch's states
            # (fired marks among them) are not written; decided again on restart.
            cut_short = in_batch
            in_batch = False
            if not isinstance(exc, asyncio.CancelledError):
                crashed = True
                unackable = unackable or exc
                health.crashed(exc)
            if crashed or cut_short:
                states.discard()
                held.clear()
            raise
        finally:
            if held and not crashed and lease.held():  # stopping: what was decided is written
                try:
                    await flush_states(ack_timeout=CHANGELOG_ACK_TIMEOUT)
                except Exception as exc:  # not committed: decided again after the restart
                    log.warning("states not flushed on stop", extra={"error": repr(exc)})

    async def guard_batch(events: list[Any]) -> None:
        if unackable is not None:
            raise RuntimeError(f"messages left unacked by an earlier failure: {unackable!r}")
        epoch = lease.epoch
        for event in events:
            reached.setdefault(event.message.tp, event.message.offset)
            event.message.incref()  # acked by flush_states, once its states are written
        held.extend(events)
        # Decide only what was fetched under a lease that holds (a frozen worker wakes with
        # it lapsed): fenced while waiting, the batch is dropped, released by the revocation.
        if not await lease.wait(epoch):
            release(events)
            return
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
        if epoch != lease.epoch:
            return  # fenced while sending: what it decided is dropped unwritten
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
            if not await lease.wait(epoch):
                return  # fenced: nothing of it written
            await flush_states()
        if lease.holds(epoch):  # eviction deletes from the changelog: only under the lease
            now = guard.clock()
            evicted = states.evict_idle(events, now - settings.state_ttl, EVICT_PER_BATCH)
            if evicted:
                log.info(
                    "evicted idle traces", extra={"evicted": evicted, "ttl": settings.state_ttl}
                )
        if goal_sends:
            await dead_letter_unsent(await send_all(goal_sends))
        for event in events:
            reached[event.message.tp] = event.message.offset + 1
