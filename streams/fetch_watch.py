"""The fetch watch: records the worker should read and does not, found and read again.

Such a stall is silent: nothing fails, the records are never read and their loops never
killed. Every WATCH_INTERVAL seconds the watch looks at three things, and acts on one that has
stood still for STALL_AFTER seconds, logging it at ERROR with the consumer's state (aiokafka's
positions, fetched results and pending tasks, Faust's partition sets and read offsets, where
every task waits):

- a partition Faust wants read whose end offset (read from the broker, not from the fetcher) is
  past its fetch position: sought where it stands, which drops a fetched result held for it
  and wakes the fetcher; a dead committed-offset refresh is restarted, a fetcher task alive for
  STUCK_TASK_AGE cancelled (both would keep a broker's partitions from being fetched);
- a table restore with changelog records left and none read: its partitions are sought to
  where the restore got to (Faust's fetch loop can drop records it took from the consumer
  around a rebalance, leaving the position at the end and the restore waiting forever);
- a span partition read past its committed offset with none of its messages in process: sought
  to its committed offset.

Counted in spanguard_fetch_stalls_total{what} and spanguard_fetch_stall_seeks_total.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from faust.types import TP

from spanguard.outcomes import CountedOutcome, Tally
from spanguard.streams.faust_internals import (
    call_in_consumer_thread,
    commit_refresh_task,
    committed_offset,
    fetch_positions,
    fetcher_assignment,
    fetcher_summary,
    fetcher_tasks,
    partition_fetch_state,
    restart_commit_refresh,
    set_read_offset,
    unacked_messages,
    wanted_partitions,
)

if TYPE_CHECKING:
    import faust

    from spanguard.streams.wiring import Worker

__all__ = ["STALL_AFTER", "WATCH_INTERVAL", "FetchCount", "FetchWatch", "Stall", "StallTracker"]

log = logging.getLogger("spanguard.worker")

# Seconds between two looks (each costs one ListOffsets request per partition leader).
WATCH_INTERVAL = 5.0
# Seconds a partition may have records waiting with its fetch position standing still.
STALL_AFTER = 15.0


class FetchCount(CountedOutcome):
    """What the fetch watch counts."""

    # Partitions found standing still with records waiting (each standing once).
    STALLED = "stalled"
    # Table restores found standing still with changelog records left to read.
    RESTORE_STALLED = "restore_stalled"
    # Span partitions read past their committed offset with none of their messages in process.
    UNPROCESSED = "unprocessed"
    # Partitions sought again (where they stood, where the restore stood, or to their committed
    # offset) to make the fetcher read them; fetcher tasks cancelled; commit refreshes restarted.
    SOUGHT = "sought"


@dataclass
class Standing:
    """Where a partition's fetch position stood, and since when."""

    position: int | None
    since: float


@dataclass(frozen=True)
class Stall:
    tp: TP
    position: int | None  # None: no fetch position at all
    end: int
    seconds: float

    def __str__(self) -> str:
        where = f"{self.tp.topic}/{self.tp.partition}"
        return f"{where} at {self.position} of {self.end} for {self.seconds:.0f}s"


@dataclass
class StallTracker:
    """Which partitions had records waiting at every look for `stall_after` seconds while
    their fetch position stood still. Each is told once per standing."""

    stall_after: float = STALL_AFTER
    standing: dict[TP, Standing] = field(default_factory=dict)
    told: set[TP] = field(default_factory=set)

    def observe(
        self, now: float, ends: dict[TP, int | None], positions: dict[TP, int | None]
    ) -> list[Stall]:
        """One look at the partitions wanted now: their end offsets and fetch positions."""
        stalled = []
        for tp, end in ends.items():
            position = positions.get(tp)
            waiting = end is not None and (position is None or end > position)
            seen = self.standing.get(tp)
            if not waiting:
                self.standing.pop(tp, None)  # the clock starts when records first wait
                self.told.discard(tp)
                continue
            if seen is None or seen.position != position:
                self.standing[tp] = Standing(position, now)
                self.told.discard(tp)
                continue
            if now - seen.since >= self.stall_after and tp not in self.told:
                assert end is not None
                stalled.append(Stall(tp, position, end, now - seen.since))
                self.told.add(tp)
        for tp in [tp for tp in self.standing if tp not in ends]:
            del self.standing[tp]  # no longer wanted (paused, revoked): a new standing later
            self.told.discard(tp)
        return stalled

    def forget(self) -> None:
        """A rebalance: positions move by seeks, every standing starts again."""
        self.standing.clear()
        self.told.clear()


@dataclass
class FetchWatch:
    worker: Worker
    tracker: StallTracker = field(default_factory=StallTracker)
    task_seen: dict[int, float] = field(default_factory=dict)
    outcomes: Tally = field(default_factory=Tally)
    # Span partitions read past their committed offset with none of their messages in process.
    unprocessed: StallTracker = field(default_factory=StallTracker)
    # The changelog records a table restore still has to read, and since when that stands.
    restore: Standing | None = None

    def __post_init__(self) -> None:
        self.worker.counted[FetchCount] = self.outcomes

    def attach(self, app: faust.App) -> None:
        app.timer(interval=WATCH_INTERVAL)(self.look)

    async def look(self) -> None:
        try:
            await self._look()
        # Starting, stopping, rebalancing: the next look tries again.
        except Exception as exc:  # noqa: BLE001
            log.debug("fetch watch skipped a look", extra={"error": repr(exc)})

    async def _look(self) -> None:
        await self._look_at_restore()
        consumer: Any = self.worker.app.consumer  # the aiokafka driver's, private state read
        if not consumer.flow_active:
            self.tracker.forget()
            self.unprocessed.forget()
            return
        wanted = wanted_partitions(consumer) & consumer.assignment()
        if not wanted:
            self.tracker.forget()
            self.unprocessed.forget()
            return
        ends = await consumer.highwaters(*wanted)
        positions = await call_in_consumer_thread(consumer, _positions, wanted)
        now = time.monotonic()
        stalled = self.tracker.observe(now, {tp: ends.get(tp) for tp in wanted}, positions)
        await self._look_at_unprocessed(now, wanted, positions)
        if stalled:
            await self._tell_and_seek(
                consumer,
                stalled,
                FetchCount.STALLED,
                "partitions not fetched: records wait on the broker, the fetch position"
                " stands still",
                "stalled",
                "stalled",
            )
        if self.tracker.told:  # at every look while any stands still
            actions = await call_in_consumer_thread(consumer, _unstick_fetcher)
            if actions:
                log.warning("fetcher unstuck", extra={"actions": actions})

    async def _look_at_unprocessed(
        self, now: float, wanted: set[TP], positions: dict[TP, int | None]
    ) -> None:
        """Span partitions fetched past their committed offset, none of whose messages is in
        process, for STALL_AFTER seconds: records taken from Kafka that no agent got."""
        consumer: Any = self.worker.app.consumer  # the aiokafka driver's, private state read
        settings = self.worker.settings
        spans = {settings.input_topic, settings.repartition_topic}
        busy = {message.tp for message in list(unacked_messages(self.worker.app))}
        fetched, committed = {}, {}
        for tp in wanted:
            if tp.topic in spans:
                done = committed_offset(consumer, tp)
                fetched[tp] = None if tp in busy or done is None else positions.get(tp)
                committed[tp] = done
        skipped = self.unprocessed.observe(now, fetched, committed)
        if skipped:
            await self._tell_and_seek(
                consumer,
                skipped,
                FetchCount.UNPROCESSED,
                "partitions read past their committed offset, none of their messages in"
                " process: records fetched that no agent got",
                "skipped",
                "unprocessed",
            )

    async def _tell_and_seek(
        self,
        consumer: Any,
        stalls: list[Stall],
        outcome: FetchCount,
        message: str,
        listed_as: str,
        reason: str,
    ) -> None:
        """Count and log partitions found standing still (`listed_as`: their key in the log
        record, beside the consumer's state and the worker's tasks), then seek each where it
        stands, for `reason`: that drops a fetched result held for it and wakes the fetcher."""
        self.outcomes.add(outcome, len(stalls))
        state = await call_in_consumer_thread(consumer, _consumer_state, consumer, self.task_seen)
        state["worker_tasks"] = _task_stacks(self.task_seen)
        log.error(message, extra={listed_as: [str(stall) for stall in stalls], "consumer": state})
        await self.seek({s.tp: s.position for s in stalls if s.position is not None}, reason)

    async def _look_at_restore(self) -> None:
        """A table restore whose records left to read stand still for STALL_AFTER seconds."""
        # TableManager's recovery: Faust's TableManagerT interface does not declare it.
        recovery = self.worker.app.tables.recovery  # type: ignore[attr-defined]
        left = recovery.active_remaining_total() if recovery.in_recovery else 0
        now = time.monotonic()
        if left <= 0:
            self.restore = None
            return
        if self.restore is None or self.restore.position != left:
            self.restore = Standing(left, now)
            return
        if now - self.restore.since < STALL_AFTER or self.restore.since < 0:
            return
        self.restore.since = -1.0  # told once per standing
        self.outcomes.add(FetchCount.RESTORE_STALLED)
        consumer: Any = self.worker.app.consumer  # the aiokafka driver's, private state read
        state = await call_in_consumer_thread(consumer, _consumer_state, consumer, self.task_seen)
        state["worker_tasks"] = _task_stacks(self.task_seen)
        left_tps = [tp for tp, count in recovery.active_remaining().items() if count > 0]
        log.error(
            "table restore stands still: changelog records left to read, none read",
            extra={
                "left": {
                    f"{tp.topic}/{tp.partition}": f"{recovery.active_offsets[tp]} of"
                    f" {recovery.active_highwaters[tp]}"
                    for tp in left_tps
                },
                "consumer": state,
            },
        )
        # The restore has applied up to active_offsets[tp]: read again from the next one.
        await self.seek(
            {tp: max(recovery.active_offsets[tp] + 1, 0) for tp in left_tps}, "table_restore"
        )

    async def seek(self, offsets: dict[TP, int], why: str) -> None:
        """Seek `offsets` in the consumer's thread, the fetcher's read offsets with them."""
        consumer: Any = self.worker.app.consumer  # the aiokafka driver's, private state read
        offsets = {tp: offset for tp, offset in offsets.items() if tp in consumer.assignment()}
        if not offsets:
            return
        # The fetcher drops a record below its partition's read offset as read already: set
        # before the seek and after (a record from before the seek may move it meanwhile).
        for tp, offset in offsets.items():
            set_read_offset(consumer, tp, offset)
        await call_in_consumer_thread(consumer, seek_in_thread, offsets)
        for tp, offset in offsets.items():
            set_read_offset(consumer, tp, offset)
        self.outcomes.add(FetchCount.SOUGHT, len(offsets))
        log.warning(
            "partitions sought to be read again",
            extra={
                "why": why,
                "offsets": {f"{tp.topic}/{tp.partition}": o for tp, o in offsets.items()},
            },
        )


async def seek_in_thread(aio: Any, offsets: dict[TP, int]) -> None:
    """Seek in the consumer's own thread (aiokafka's fetcher is not thread-safe)."""
    for tp, offset in offsets.items():
        aio.seek(tp, offset)


# A fetcher task (a fetch, or an offset reset waiting for the committed offsets) older than
# this is stuck: its node gets no fetch while it lives. Requests time out well before.
STUCK_TASK_AGE = 120.0


async def _unstick_fetcher(aio: Any) -> list[str]:
    """In the consumer's thread: restart the committed-offset refresh if it died (offset
    resets wait on it without a timeout), cancel fetcher tasks alive for STUCK_TASK_AGE."""
    actions = []
    assignment = fetcher_assignment(aio)
    refresh = commit_refresh_task(aio)
    if assignment is not None and assignment.active and (refresh is None or refresh.done()):
        died = None if refresh is None or refresh.cancelled() else refresh.exception()
        restart_commit_refresh(aio, assignment)
        actions.append(f"committed-offset refresh restarted (it ended with {died!r})")
    now = time.monotonic()
    for task in fetcher_tasks(aio):
        born = _TASK_BORN.get(id(task), now)
        if now - born >= STUCK_TASK_AGE and not task.done():
            task.cancel()
            actions.append(f"fetcher task cancelled after {now - born:.0f}s")
    return actions


def _note_fetcher_tasks(aio: Any) -> None:
    """When each pending fetcher task was first seen (by id), forgetting finished ones."""
    now = time.monotonic()
    alive = {id(task) for task in fetcher_tasks(aio)}
    for gone in _TASK_BORN.keys() - alive:
        del _TASK_BORN[gone]
    for task_id in alive:
        _TASK_BORN.setdefault(task_id, now)


# When the watch first saw each fetcher task (by id), in the consumer's thread.
_TASK_BORN: dict[int, float] = {}


async def _positions(aio: Any, tps: set[TP]) -> dict[TP, int | None]:
    """The fetch position of each of `tps` (None: none yet), read in the consumer's thread."""
    _note_fetcher_tasks(aio)
    return fetch_positions(aio, tps)


def _describe_task(task: asyncio.Task, seen: dict[int, float], now: float) -> str:
    """The chain of awaits a task waits in, innermost last, and how long it has existed."""
    first = seen.setdefault(id(task), now)
    chain: list[str] = []
    awaited: Any = task.get_coro()
    while awaited is not None and len(chain) < 12:
        frame = next(
            (
                getattr(awaited, a)
                for a in ("cr_frame", "gi_frame", "ag_frame")
                if hasattr(awaited, a)
            ),
            None,
        )
        chain.append(
            f"{frame.f_code.co_name}:{frame.f_lineno}"
            if frame is not None
            else type(awaited).__name__
        )
        awaited = next(
            (
                getattr(awaited, a)
                for a in ("cr_await", "gi_yieldfrom", "ag_await")
                if getattr(awaited, a, None) is not None
            ),
            None,
        )
    return f"{' > '.join(chain)} ({now - first:.0f}s)"


def _task_stacks(seen: dict[int, float]) -> list[str]:
    """Where each task of the calling thread's event loop waits (its innermost frames)."""
    now = time.monotonic()
    return sorted(_describe_task(task, seen, now) for task in asyncio.all_tasks())


async def _consumer_state(aio: Any, consumer: Any, seen: dict[int, float]) -> dict[str, Any]:
    """aiokafka's fetcher and Faust's partition sets, read in the consumer's thread."""
    now = time.monotonic()
    assignment = fetcher_assignment(aio)
    partitions = {
        f"{tp.topic}/{tp.partition}": partition_fetch_state(aio, consumer, tp)
        for tp in sorted(assignment.tps)
    }
    summary = fetcher_summary(aio)
    refresh = commit_refresh_task(aio)
    fetch_task = summary["fetch_task"]
    return {
        "in_flight": summary["in_flight"],
        "pending": [_describe_task(t, seen, now) for t in fetcher_tasks(aio)],
        "fetch_task": _describe_task(fetch_task, seen, now) if fetch_task is not None else None,
        "commit_refresh": None
        if refresh is None
        else ("done" if refresh.done() else _describe_task(refresh, seen, now)),
        "generation": summary["generation"],
        "consumer_tasks": _task_stacks(seen),
        "flow_active": consumer.flow_active,
        "partitions": partitions,
    }
