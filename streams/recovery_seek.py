"""A second seek to the committed offsets once Faust's recovery is complete: records Faust
drops while it resumes the streams are read again, not skipped.

faust-streaming 0.15.3 ends every rebalance in `Recovery.on_recovery_completed`, in this order:

1. resume the stream partitions (the fetcher hands their records to the agents' queues again:
   the consumer's flow was resumed when the table restore began);
2. seek each of them to its committed offset, one OffsetFetch request after another;
3. `flow_control.resume()`, which empties every stream's queue (`clear_on_resume`).

A record fetched after its partition's seek (2) and still queued at (3) is dropped, and the
fetch position is past it: nothing reads it again until the next rebalance. A worker that takes
over partitions with records waiting (another worker frozen or cut off) loses some of them this
way: the loops in them are never killed while the other worker stays away. The fault tests saw
it in 2 of 13 frozen-worker runs: the takeover decided 1 loop in the partitions it took, then
nothing from them for minutes.

Seeking again after (3) reads those records again. The ones an agent processed meanwhile come
twice: the guard recognizes a span it has counted (by span id), and a repeated decision keeps
its id (agents obey an id once).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import faust

__all__ = ["SeekAfterRecovery"]

log = logging.getLogger("spanguard.worker")


class SeekAfterRecovery:
    """Wraps the app's Recovery.on_recovery_completed with a second seek; counts the seeks."""

    def __init__(self) -> None:
        self.seeks = 0

    def attach(self, app: faust.App) -> None:
        recovery = app.tables.recovery
        recovery.on_recovery_completed = self._seeking_again(app, recovery.on_recovery_completed)  # type: ignore[method-assign]

    @staticmethod
    def watch_clears(app: faust.App) -> None:
        """Log what each `flow_control.resume()` drops from the queues: events of the current
        generation are records the worker will not read again without a seek."""
        flow = app.flow_control
        clear = flow.clear

        def clear_counting() -> None:
            current = app.consumer_generation_id
            dropped: dict[str, int] = {}
            for queue in list(flow._queues):
                for item in list(getattr(queue, "_queue", ())):
                    message = getattr(item, "message", None)
                    if message is None or message.generation_id != current:
                        continue
                    where = f"{message.topic}/{message.partition}"
                    dropped[where] = dropped.get(where, 0) + 1
            if dropped:
                log.warning(
                    "flow control emptied the queues: records of this generation dropped",
                    extra={"dropped": dropped, "generation": current},
                )
            clear()

        flow.clear = clear_counting  # type: ignore[method-assign]

    def _seeking_again(
        self, app: faust.App, completed: Callable[..., Awaitable[None]]
    ) -> Callable[..., Awaitable[None]]:
        async def completed_then_seek_again(generation_id: int = 0) -> None:
            await completed(generation_id)
            if app.consumer_generation_id != generation_id or not app.consumer.assignment():
                return  # rebalancing again: that recovery seeks, then this one again
            await app.consumer.perform_seek()
            self.seeks += 1
            log.debug("stream partitions sought to their committed offsets again")

        return completed_then_seek_again
