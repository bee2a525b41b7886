"""The goal agent: ended agent invocations, from a topic of their own, to the goal verifier. A
slow judge delays verdicts, never loop or budget decisions."""

from __future__ import annotations

import logging

import faust

from spanguard.detection.pipeline import Outcome
from spanguard.streams.delivery import send_all
from spanguard.streams.wiring import Worker

__all__ = ["register"]

log = logging.getLogger("spanguard.worker")


def register(worker: Worker) -> None:
    verifier, outbox = worker.verifier, worker.outbox

    @worker.app.agent(worker.goal_checks, name="verify-goals", concurrency=4)
    async def check_goals(stream: faust.StreamT) -> None:
        async for event in stream.events():
            message = event.message
            if verifier is None:
                continue
            try:
                decisions, errors = await verifier.check(message.value)
            except Exception as exc:  # one bad message must never stop the agent
                log.exception("goal verifier failed on a message")
                decisions, errors = [], [f"internal error in the goal verifier: {exc!r}"]
            sends = outbox.sends_for(Outcome(decisions=decisions), message)
            sends.extend(outbox.dead_letter(message, error) for error in errors)
            await send_all(sends)
