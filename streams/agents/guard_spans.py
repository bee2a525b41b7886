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
    settings, states, guard, health = worker.settings, worker.states, worker.guard, worker.health
    verify_goals = worker.verifier is not None and worker.verifier.wanted

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
        states.begin_batch()
        sends: list[Send] = []
        goal_sends: list[Send] = []
        for event in events:
            message = event.message
            with event_context(event):
                outcome = worker.pipeline.handle(message.key, message.value)  # never raises
            sends.extend(worker.outbox.sends_for(outcome, message))
            if verify_goals and outcome.has_root_span:
                goal_sends.append(
                    Send(worker.goal_checks, {"key": message.key, "value": message.value})
                )
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
        states.flush()
        evicted = states.evict_idle(events, guard.clock() - settings.state_ttl, EVICT_PER_BATCH)
        if evicted:
            log.info("evicted idle traces", extra={"evicted": evicted, "ttl": settings.state_ttl})
        if goal_sends:
            await send_all(goal_sends)
