"""Faust's flow control resume keeps the records of the current generation in the agents'
queues instead of dropping them.

faust-streaming 0.15.3 ends every rebalance in `Recovery.on_recovery_completed`, in this order:

1. resume the stream partitions: the fetcher hands their records to the agents' queues again
   (the consumer's flow was resumed when the table restore began);
2. seek each of them to its committed offset, one OffsetFetch request after another;
3. `flow_control.resume()`, which empties every queue made with `clear_on_resume` (the
   streams' and the table restore's).

A record fetched after its partition's seek (2) and still queued at (3) is dropped with the
fetch position past it: nothing reads it again until the next rebalance. A worker taking over
partitions with records waiting (another worker frozen or cut off) loses some of them this way,
and the loops in them go unkilled while the other worker stays away (the fault tests saw it in
2 of 13 frozen-worker runs, and the worker's log in several more).

What the clear is for is the records of an earlier generation, fetched before the rebalance:
the streams skip those anyway. `KeepCurrentOnResume` wraps the app's `flow_control.resume` so
that the records of the current generation stay queued, in order, and reach their agents. A
record that also comes again from the seek (fetched before it) is processed twice: the guard
recognizes a span it has counted (by span id), and a repeated decision keeps its id (agents obey
an id once). The revocation's own `flow_control.clear()` is left as it is.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spanguard.outcomes import CountedOutcome, Tally
from spanguard.streams.faust_internals import (
    flow_control_queues,
    queued_items,
    requeue,
    wrap_flow_control_resume,
)

if TYPE_CHECKING:
    import faust

__all__ = ["KeepCurrentOnResume", "ResumeCount", "current_events"]

log = logging.getLogger("spanguard.worker")


class ResumeCount(CountedOutcome):
    """What the flow control resume counts."""

    # Records of the current generation Faust's resume would have dropped, kept queued.
    RECORDS_KEPT = "records_kept"


def current_events(queue: Any, generation: int) -> list[Any]:
    """The queued events of `generation`, in queue order (what a clear must not drop)."""
    return [
        item
        for item in queued_items(queue)
        if getattr(getattr(item, "message", None), "generation_id", None) == generation
    ]


class KeepCurrentOnResume:
    """Wraps `app.flow_control.resume`: its clear drops the earlier generations' records only."""

    def __init__(self, app: faust.App, outcomes: Tally | None = None) -> None:
        self.app = app
        self.outcomes = outcomes if outcomes is not None else Tally()

    def attach(self) -> None:
        wrap_flow_control_resume(self.app, self.keeping_current)

    def keeping_current(self, resume: Callable[[], None]) -> Callable[[], None]:
        def resume_keeping_current() -> None:
            generation = self.app.consumer_generation_id
            queues = flow_control_queues(self.app)
            kept = {queue: current_events(queue, generation) for queue in queues}
            resume()  # resumes, then empties every queue it manages
            where: Counter[str] = Counter()
            for queue, events in kept.items():
                if events:
                    # Synchronous since the clear: nothing was queued or taken meanwhile.
                    requeue(queue, events)
                    where.update(f"{e.message.topic}/{e.message.partition}" for e in events)
            if where:
                self.outcomes.add(ResumeCount.RECORDS_KEPT, sum(where.values()))
                log.info(
                    "flow control resumed: records of this generation kept for their agents",
                    extra={"kept": dict(where), "generation": generation},
                )

        return resume_keeping_current
