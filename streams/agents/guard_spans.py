"""The span agent: batches of OTLP messages through the guard, their sends acked before commit."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import faust

from spanguard.streams.delivery import Send, send_all
from spanguard.streams.state import event_context
from spanguard.streams.wiring import Worker

__all__ = ["EVICT_PER_BATCH", "register"]

log = logging.getLogger("spanguard.worker")

# Idle traces deleted per batch at most: eviction never stalls the event loop.
EVICT_PER_BATCH = 256


def register(worker: Worker) -> None:
    app, settings, states = worker.app, worker.settings, worker.states
    guard, health, outbox = worker.guard, worker.health, worker.outbox
    verify_goals = worker.verifier is not None and worker.verifier.wanted
    # Where the span agent got to in each source partition: the offset after the last message
    # of a completed batch, or the first one of a batch still running. Records between it and
    # the partition's highwater are waiting on the agent (health: stuck while lag grows).
    reached: dict[Any, int] = {}

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
        # Messages come in small batches: each trace's state is written once per batch, and
        # the batch's events are acknowledged (and later committed) only after its signals are
        # acked by the broker and its state is written.
        try:
            async for events in stream.take_events(settings.batch_size, within=0.002):
                await guard_batch(events)
                health.progressed()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                health.crashed(exc)
            raise

    async def guard_batch(events: list[Any]) -> None:
        for event in events:
            reached.setdefault(event.message.tp, event.message.offset)
        states.begin_batch()
        sends: list[Send] = []
        goal_sends: list[Send] = []
        for event in events:
            message = event.message
            with event_context(event):
                outcome = worker.pipeline.handle(message.key, message.value)  # never raises
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
        states.flush()
        evicted = states.evict_idle(events, guard.clock() - settings.state_ttl, EVICT_PER_BATCH)
        if evicted:
            log.info("evicted idle traces", extra={"evicted": evicted, "ttl": settings.state_ttl})
        if goal_sends:
            await dead_letter_unsent(await send_all(goal_sends))
        for event in events:
            reached[event.message.tp] = event.message.offset + 1
