"""Records Faust drops from the agents' queues when it resumes its flow control are read again.

faust-streaming 0.15.3 ends every rebalance in `Recovery.on_recovery_completed`, in this order:

1. resume the stream partitions: the fetcher hands their records to the agents' queues again
   (the consumer's flow was resumed when the table restore began);
2. seek each of them to its committed offset, one OffsetFetch request after another;
3. `flow_control.resume()`, which empties every queue made with `clear_on_resume` (the
   streams' and the table restore's).

A record fetched after its partition's seek (2) and still queued at (3) is dropped with the
fetch position past it: nothing reads it again until the next rebalance. A worker taking over
partitions with records waiting (another worker frozen or cut off) loses some of them this way,
and the loops in them go unkilled while the other worker stays away.

`FlowControlSeekBack` wraps the app's flow control: before a resume empties the queues, it notes
the lowest offset dropped per partition among records of the current generation (older ones are
skipped by the streams anyway, and read again by the seek of their own rebalance), and seeks
each such partition back there. The records an agent already processed after that offset come
twice: the guard recognizes a span it has counted (by span id), and a repeated decision keeps
its id (agents obey an id once).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from faust.types import TP

from spanguard.outcomes import CountedOutcome, Tally

if TYPE_CHECKING:
    import faust

__all__ = ["FlowControlSeekBack", "SeekBackCount", "dropped_offsets"]

log = logging.getLogger("spanguard.worker")


class SeekBackCount(CountedOutcome):
    """What the seek back counts."""

    # Records of the current generation that a flow control resume dropped from the queues.
    RECORDS_DROPPED = "records_dropped"
    # Partitions sought back to the first of them.
    PARTITIONS_SOUGHT_BACK = "partitions_sought_back"


def dropped_offsets(queues: Any, generation: int) -> tuple[dict[TP, int], int]:
    """Per partition, the lowest offset among the queued events of `generation` (what a clear
    of `queues` drops), and how many such events there are."""
    lowest: dict[TP, int] = {}
    count = 0
    for queue in list(queues):
        for item in list(getattr(queue, "_queue", ())):
            message = getattr(item, "message", None)
            if message is None or message.generation_id != generation:
                continue
            count += 1
            tp = message.tp
            lowest[tp] = min(message.offset, lowest.get(tp, message.offset))
    return lowest, count


class FlowControlSeekBack:
    """Wraps `app.flow_control.clear` (what its `resume()` calls) with the seek back."""

    def __init__(self, app: faust.App, outcomes: Tally | None = None) -> None:
        self.app = app
        self.outcomes = outcomes if outcomes is not None else Tally()
        self.pending: set[asyncio.Task] = set()

    def attach(self) -> None:
        flow = self.app.flow_control
        clear = flow.clear

        def clear_then_seek_back() -> None:
            generation = self.app.consumer_generation_id
            lowest, count = dropped_offsets(flow._queues, generation)
            clear()
            if lowest:
                self.outcomes.add(SeekBackCount.RECORDS_DROPPED, count)
                task = asyncio.ensure_future(self.seek_back(lowest, generation))
                self.pending.add(task)
                task.add_done_callback(self.pending.discard)

        flow.clear = clear_then_seek_back  # type: ignore[method-assign]

    async def seek_back(self, lowest: dict[TP, int], generation: int) -> None:
        consumer = self.app.consumer
        if self.app.consumer_generation_id != generation:
            return  # rebalancing again: its recovery seeks to the committed offsets
        assigned = consumer.assignment()
        sought = {tp: offset for tp, offset in lowest.items() if tp in assigned}
        # The fetcher drops a record below its partition's read offset as read already: set
        # before the seek (the first records from there may come before this task goes on)
        # and after (a record from before the seek may have moved it meanwhile).
        for tp, offset in sought.items():
            consumer._read_offset[tp] = offset
        thread = consumer._thread
        await thread.call_thread(_seek, thread._ensure_consumer(), sought)
        for tp, offset in sought.items():
            consumer._read_offset[tp] = offset
        self.outcomes.add(SeekBackCount.PARTITIONS_SOUGHT_BACK, len(sought))
        log.warning(
            "records dropped from the queues by a flow control resume: their partitions"
            " sought back to read them again",
            extra={
                "sought": {f"{tp.topic}/{tp.partition}": offset for tp, offset in sought.items()},
                "generation": generation,
            },
        )


async def _seek(aio: Any, offsets: dict[TP, int]) -> None:
    """Seek in the consumer's own thread (aiokafka's fetcher is not thread-safe)."""
    for tp, offset in offsets.items():
        aio.seek(tp, offset)
