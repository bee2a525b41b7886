"""The flush-and-ack protocol (`WriteBack`): an agent's message is acked, so its offset
committable, only once the states it changed are written and acked by the changelog and the
records it sent are acked by the broker (docs/design.md, "State writes once per commit"). And
the scope agents' batches over it (`ScopeAgent`).

One message's way through it (acked: its offset can be committed)::

    taken --hold--> held --flush--> written --changelog, records acked--> durable --ack--> acked

    fenced (a rebalance):  held, written --drop_fenced--> dropped unwritten, released unacked
    crash:                 held --fail--> dropped unwritten, left unacked with Faust
    give-up:               written --acks not in time (a stop), or fenced--> left unacked

- hold: a batch's messages each keep one more reference (their ack) until the flush that
  writes their states; records the batch produced without waiting (`defer`) and the scope
  records the agent holds back (`WriteBackHooks`) wait with them.
- flush: once per commit interval (`flush_due`), at a batch's end or between batches on the
  timer (`flush_when_idle`), and at once when Faust waits for every message to be acked (a
  rebalance, a stop: `flush_before_waiting`). The states are written, the held records
  produced, and the messages move to `written` together: no batch adds to one and not the
  other in between.
- durable: the changelog acked the writes and the broker the records; a record refused leaves
  a dead letter first (`dead_letter_refused`). Then the messages are acked: no offset is
  committed ahead of its state or of a record it sent.

On a rebalance, whatever is held is flushed before Faust waits; a worker whose lease lapsed
(streams/fence.py) writes nothing more (the partitions may be another's already): it drops
what is unwritten and releases its messages, held or written, unacked: Faust stops waiting on
them and the next owner decides them again from the committed offsets and the changelog.
On a stop, a batch cut short is dropped unwritten (`drop_unwritten`), what was decided before
it is flushed, and the acks are awaited a bounded time (`flush_on_stop`).
On a crash (a batch that raised, a flush that failed: `fail`), what is unwritten is dropped and
its messages stay unacked: the stream's topics commit nothing more (Faust would commit past
them once it acked a later message itself) and Faust no longer waits for their messages (a
stop or a rebalance would wait for ever); every later batch raises until the restart decides
them again (health: crashed, then /livez red).
On give-up (the acks not in time on a stop, or fenced while awaiting them) the messages stay
unacked, decided again after the restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import faust
from faust.types import EventT

from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.delivery import Produced, Send, produce, send_all
from spanguard.streams.faust_internals import (
    freeze_commits,
    stop_waiting_for,
    stop_waiting_for_topics,
    wrap_consumer_wait_empty,
)
from spanguard.streams.fence import Lease
from spanguard.streams.state_table import StateTable

if TYPE_CHECKING:
    from spanguard.streams.wiring import Worker

__all__ = [
    "CHANGELOG_ACK_TIMEOUT",
    "FLUSH_CHECK_INTERVAL",
    "NoHooks",
    "ScopeAgent",
    "WriteBack",
    "WriteBackHooks",
]

log = logging.getLogger("spanguard.worker")

# Seconds between two looks of the flush timer (a due flush waits at most this long when idle).
FLUSH_CHECK_INTERVAL = 0.1
# Seconds of encoding and storing states a flush step takes (`WriteBack.write_step`): a kill
# that arrives during a flush waits for one step.
FLUSH_STEP_SECONDS = 0.002
# Seconds a flush waits for its changelog acks on a stop, before leaving them unacked (decided
# again after the restart); running, it waits as long as the lease holds.
CHANGELOG_ACK_TIMEOUT = 10.0


class WriteBackHooks(Protocol):
    """What an agent adds to its write-back: records it holds back to send with the next
    flush, and the count of the dead letters a flush left."""

    def take_scope_records(self) -> list[Send]:
        """The records held back (the span agent's for the conversation and agent-window
        scopes), taken to be sent now. (Not `WriteBack.held`: those are messages.)"""
        ...

    def drop_scope_records(self) -> None:
        """Drop the records held back, unsent: their messages will not be acked (a fence, a
        failure), so they are decided and sent again."""
        ...

    def count_dead_letters(self, pointers: int) -> None:
        """Told of the dead letters a flush left for records the broker refused."""
        ...


class NoHooks:
    """An agent that holds back no records and counts no dead letters (the scope agents)."""

    def take_scope_records(self) -> list[Send]:
        return []

    def drop_scope_records(self) -> None:
        """Nothing held back."""

    def count_dead_letters(self, pointers: int) -> None:
        """Not counted."""


@dataclass(slots=True)
class _Flushing:
    """A flush whose states are still being written: its messages, the records they sent,
    the lease epoch it began under, and how its acks are awaited."""

    written: list[EventT]
    records: list[tuple[Send, Produced]]
    epoch: int
    ack_timeout: float | None
    acks_in_background: bool
    # Set once the flush has sent what it began with (the steps of the flush before it, its
    # scope records): until then its records are not all known, so no other step may write
    # or ack it, and no other flush may begin after it.
    begun: asyncio.Event = field(default_factory=asyncio.Event)


class WriteBack:
    """One agent's flush-and-ack protocol (the module's docstring draws it) over a
    DecodedStates table: the span agent's over the trace table, the conversation and
    agent-windows agents' over theirs, each with its own held messages, flush timer and
    failure, under the worker's one lease on its partitions (streams/fence.py).

    An agent runs its batches through `run_batches` and, in each batch, takes its messages
    with `hold`, opens the flush window (`states.begin_batch()`), and flushes at its end once
    `flush_due()`; `attach` registers the flush timer and the flush before Faust waits for
    every message to be acked (a rebalance, a stop)."""

    def __init__(
        self,
        worker: Worker,
        states: DecodedStates,
        table: StateTable,
        lease: Lease,
        hooks: WriteBackHooks | None = None,
    ) -> None:
        self.worker = worker
        self.states = states
        self.table = table
        self.lease = lease
        self.hooks: WriteBackHooks = NoHooks() if hooks is None else hooks
        # Held: messages whose changed states are not written yet, each holding its ack.
        self.held: list[EventT] = []
        # Written: messages whose states are written, waiting for the acks (one list per flush).
        self.written: list[list[EventT]] = []
        self.flushed_at = time.monotonic()
        self.in_batch = False
        self.draining = False  # Faust waits for every message to be acked: flush at once
        # A failure (a batch that raised, a flush that failed) left messages that can never be
        # acked, so no offset after them would be committed: every batch after it fails too,
        # loudly, until the restart decides them again (health: crashed, then /livez red).
        self.unackable: BaseException | None = None
        self.source_topics: tuple[str, ...] = ()  # the topics its stream reads
        # The lease's last fenced epoch whose unwritten states this agent has dropped.
        self.dropped_epoch = lease.epoch
        # Records produced since the last flush whose acks it awaits before acking `held`.
        self.deferred: list[tuple[Send, Produced]] = []
        # Scope records are produced under it, in the order they were taken: the agent-window
        # agent drops a row older than one it already counted.
        self.producing = asyncio.Lock()
        # Flushes whose acks are awaited by a task of their own (`flush`).
        self.acking: set[asyncio.Future[None]] = set()
        # A flush whose states are written a step at a time (`flush(in_steps=True)`).
        self.flushing: _Flushing | None = None

    def attach(self, app: faust.App) -> None:
        app.timer(interval=FLUSH_CHECK_INTERVAL)(self.flush_when_idle)
        # A rebalance and a stop both wait, in App._consumer_wait_empty, until every message
        # taken is acked, with timers already stopped on a stop: the held messages are flushed
        # first (a batch still running flushes as it ends), so neither waits out the interval
        # or forever.
        wrap_consumer_wait_empty(app, self.flush_before_waiting)

    # -- batches: hold ---------------------------------------------------------------------

    async def run_batches(
        self,
        stream: faust.StreamT,
        within: float,
        guard_batch: Callable[[list[EventT]], Awaitable[None]],
        progressed: Callable[[], None] = lambda: None,
    ) -> None:
        """Take the stream's messages in batches of up to `batch_size` (waiting at most
        `within` seconds for one to fill) and guard each; on a stop, what was decided is
        flushed, on a failure nothing more is written."""
        failed = False
        self.source_topics = tuple(getattr(stream.channel, "topics", None) or ())
        try:
            # The generator is never bound to a name: on a crash the traceback keeps this frame,
            # and a generator held by it would never close, so the restarted agent would wait
            # on a stream the dead one still iterates. (take_events is Stream's, not on the
            # StreamT interface Faust types it by.)
            async for events in stream.take_events(  # type: ignore[attr-defined]
                self.worker.settings.batch_size, within=within
            ):
                self.in_batch = True
                await guard_batch(events)
                self.in_batch = False
                progressed()
        except BaseException as exc:
            failed = self.interrupted(exc)
            raise
        finally:
            if (self.held or self.flushing is not None) and not failed and self.lease.held():
                await self.flush_on_stop()

    def hold(self, events: list[EventT]) -> int:
        """Take a batch's messages: each holds its ack until the flush that writes its states.
        Returns the lease epoch the batch was fetched under."""
        if self.unackable is not None:
            raise RuntimeError(f"messages left unacked by an earlier failure: {self.unackable!r}")
        for event in events:
            event.message.incref()  # acked once durable (`flush`)
        self.held.extend(events)
        return self.lease.epoch

    def defer(self, sends: list[Send], produced: list[Produced]) -> None:
        """Records produced without waiting for the broker: the next flush awaits their acks
        before it acks the messages held with them."""
        self.deferred.extend(zip(sends, produced, strict=True))

    async def send_scope_records(self) -> None:
        """Send the scope records held back before the flush would: produced in the order
        taken, their acks awaited by the next flush with the messages they came from."""
        epoch = self.lease.epoch
        async with self.producing:
            sends = self.hooks.take_scope_records()
            if sends:
                produced = await produce(sends)
                if epoch == self.lease.epoch:  # fenced meanwhile: dropped with their messages
                    self.defer(sends, produced)

    def interrupted(self, exc: BaseException) -> bool:
        """The batches stopped or failed, maybe mid-batch with kills not yet acked: that
        batch's states (fired marks among them) are not written, decided again on restart.
        True if failed."""
        cut_short, self.in_batch = self.in_batch, False
        failed = not isinstance(exc, asyncio.CancelledError)
        if failed:
            self.fail(exc)
        elif cut_short:
            self.drop_unwritten()
        return failed

    # -- flush: write, then ack once durable -----------------------------------------------

    def flush_due(self) -> bool:
        due = time.monotonic() - self.flushed_at >= self.worker.settings.commit_interval
        return bool(self.held) and (due or self.draining)

    async def flush(
        self,
        ack_timeout: float | None = None,
        *,
        acks_in_background: bool = False,
        in_steps: bool = False,
    ) -> None:
        """Write the states changed since the last flush and, once the changelog has acked
        them and the broker the records deferred since the last flush, let their messages be
        acked: no offset is committed ahead of its state or of a record it sent. A flush
        still writing its steps is written to its end first.

        `acks_in_background`: return once the writes and records are handed to the producer,
        the acks awaited (and the messages acked) by a task of their own, so the batch after
        does not wait out the changelog's round trip (`acking`). A failure there is the
        agent's failure, as a flush between batches is.

        `in_steps`: write only a step's worth of the states now (`write_step` writes the rest,
        a step at a time, between batches), so that a kill arriving meanwhile waits for one
        step, not for the encoding of every state changed in a commit interval."""
        starting = self.flushing
        if starting is not None and not starting.begun.is_set():
            await starting.begun.wait()  # a flush begun on the timer, still sending
        epoch = self.lease.epoch
        previous = self.flushing
        if previous is not None and previous.epoch != epoch:
            return  # fenced since it began: the fence drops both (`drop_fenced`)
        # Nothing awaited from here to the flush's taking of what it writes: no batch adds to
        # the states, the messages or the records in between. What a flush in steps left
        # unwritten is written first.
        self.states.start_flush()
        self.flushed_at = time.monotonic()
        # The messages, the records they deferred and those they hold, taken together.
        written = self.held.copy()
        self.held.clear()
        records, self.deferred = self.deferred, []
        scope_records = self.hooks.take_scope_records()
        self.written.append(written)
        self.flushing = flushing = _Flushing(
            written, records, epoch, ack_timeout, acks_in_background
        )
        try:
            if previous is not None:  # its states all stored now
                await self.table.send_pending()
                await self._ack_when_durable(previous)
            if scope_records:
                async with self.producing:
                    produced = await produce(scope_records)
                records.extend(zip(scope_records, produced, strict=True))
        except BaseException:
            self._abandon(flushing)
            raise
        finally:
            flushing.begun.set()
        await self._write_steps(FLUSH_STEP_SECONDS if in_steps else None)

    async def write_step(self) -> None:
        """Write a step of the flush under way, if any: between batches only (a state written
        carries every decision made on it, and a batch's signals are acked before it ends)."""
        if self.flushing is not None:
            await self._write_steps(FLUSH_STEP_SECONDS)

    async def _write_steps(self, seconds: float | None) -> None:
        """Write the flush's states for about `seconds` (all of them with None) and send their
        changelog records; once the last is sent, its acks are awaited."""
        flushing = self.flushing
        if flushing is None or not flushing.begun.is_set():
            # None: fenced while it began. Not begun: a batch's step or the timer's while the
            # flush still sends what it began with; the flush writes its first step itself.
            return
        if flushing.epoch != self.lease.epoch:
            return  # fenced since it began: the fence drops it with its messages (`drop_fenced`)
        try:
            # The step that writes the last state claims the flush's acks: another step under
            # way (the timer's, awaiting its sends while a batch ended) finds nothing to ack.
            last = self.states.write_some(seconds) and self.flushing is flushing
            if last:
                self.flushing = None
            await self.table.send_pending()
        except BaseException:
            self._abandon(flushing)
            raise
        if last:
            await self._ack_when_durable(flushing)

    async def _ack_when_durable(self, flushing: _Flushing) -> None:
        """Every state of `flushing` sent: its messages are acked once the changelog records
        sent so far and its records are acked, awaited here or by a task of their own."""
        changelog = self.table.take_unconfirmed()
        acked = self._ack_once_durable(
            flushing.written, changelog, flushing.records, flushing.epoch, flushing.ack_timeout
        )
        if not flushing.acks_in_background:
            await acked
            return
        task = asyncio.ensure_future(self._or_fail(acked))
        self.acking.add(task)
        task.add_done_callback(self.acking.discard)

    def _abandon(self, flushing: _Flushing) -> None:
        """A flush that failed: its messages are no longer waited on as written (the failure
        leaves them unacked), its states left unwritten."""
        self.written = [batch for batch in self.written if batch is not flushing.written]
        if self.flushing is flushing:
            self.flushing = None

    async def _ack_once_durable(
        self,
        written: list[EventT],
        changelog: list[Awaitable[Any]],
        records: list[tuple[Send, Produced]],
        epoch: int,
        ack_timeout: float | None,
    ) -> None:
        """Ack a flush's messages once its changelog writes and records are acked."""
        try:
            unsent = await self._durable(changelog, records, epoch, ack_timeout)
            if unsent is None:
                return  # fenced meanwhile (the revocation released them) or stopping
            if unsent:
                await self.dead_letter_refused(unsent)
                if epoch != self.lease.epoch:
                    return
        finally:
            self.written = [batch for batch in self.written if batch is not written]
        for event in written:
            event.ack()  # our reference; the take buffer acked its own after the batch

    async def _durable(
        self,
        writes: list[Awaitable[Any]],
        records: list[tuple[Send, Produced]],
        epoch: int,
        # None or a deadline the loop checks between acks, as `flush` passes it.
        timeout: float | None,  # noqa: ASYNC109
    ) -> list[tuple[Send, BaseException]] | None:
        """Wait for the broker's acks of the changelog `writes` and the deferred `records`;
        the records that failed and why, or None if fenced or out of time first. A refused
        changelog write raises: its messages can never be acked."""
        unsent: list[tuple[Send, BaseException]] = []
        waiting: dict[asyncio.Future[Any], Send | None] = {}
        send: Send | None
        for write in writes:
            waiting[asyncio.ensure_future(write)] = None
        for send, produced in records:
            if isinstance(produced, BaseException):  # refused by the producer
                unsent.append((send, produced))
            else:
                waiting[asyncio.ensure_future(produced)] = send
        # Most are acked by the flush: only those still in flight are waited on.
        done = [future for future in waiting if future.done()]
        pending = {future for future in waiting if not future.done()}
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for future in done:
                send = waiting[future]
                if send is None:
                    future.result()
                elif future.cancelled():
                    unsent.append((send, asyncio.CancelledError()))
                elif (error := future.exception()) is not None:
                    unsent.append((send, error))
            if not pending:
                break
            if epoch != self.lease.epoch:
                return None
            if deadline is not None and time.monotonic() >= deadline:
                log.warning("changelog or records not acked in time; their messages stay unacked")
                return None
            finished, pending = await asyncio.wait(pending, timeout=FLUSH_CHECK_INTERVAL)
            done = list(finished)
        return unsent if epoch == self.lease.epoch else None

    async def dead_letter_refused(self, unsent: list[tuple[Send, BaseException]]) -> None:
        """Deferred records the broker refused: each leaves a dead letter pointing at its
        source message, with why, before that message is acked. A dead letter that cannot be
        written either raises: its message must never be acked (decided again on restart)."""
        for send, error in unsent:
            log.error(
                "record not written",
                extra={"topic": send.topic.get_topic_name(), "error": repr(error)},
            )
        failed, errors = [send for send, _ in unsent], [error for _, error in unsent]
        pointers = self.worker.outbox.pointers_to_unsent(failed, errors)
        self.hooks.count_dead_letters(len(pointers))
        lost = await send_all(pointers)
        if lost:
            raise RuntimeError(
                f"{len(lost)} dead letters of records not written could not be written either"
            )

    # -- when to flush ---------------------------------------------------------------------

    async def flush_when_idle(self) -> None:
        # Between batches only: a batch's retractions write to states it has open. Not on a
        # lapsed lease: the flush waits for the renewal, or is dropped by the fence.
        if self.in_batch or not self.lease.held():
            return
        if self.flush_due() and self.flushing is None:
            await self._or_fail(self.flush(acks_in_background=True, in_steps=True))
        # A flush's steps, while no batch runs, each followed by a pause as long: a message
        # that arrives meanwhile reaches the agent (its batch waits a moment to fill, which a
        # bare yield would not let pass) and its batch starts after one step; the rest waits
        # for its end.
        while self.flushing is not None and not self.in_batch and self.lease.held():
            await self._or_fail(self.write_step())
            await asyncio.sleep(FLUSH_STEP_SECONDS)

    async def flush_outside_batch(self) -> None:
        await self._or_fail(self.flush())

    async def flush_on_stop(self) -> None:
        """Stopping: what was decided is written, its changelog acks awaited a bounded time
        (and those of earlier flushes still awaited in the background)."""
        try:
            await self.flush(ack_timeout=CHANGELOG_ACK_TIMEOUT)
        except Exception as exc:  # not committed: decided again after the restart  # noqa: BLE001
            log.warning("states not flushed on stop", extra={"error": repr(exc)})
        if self.acking:
            await asyncio.wait(set(self.acking), timeout=CHANGELOG_ACK_TIMEOUT)

    def flush_before_waiting(
        self, wait_empty: Callable[..., Awaitable[None]]
    ) -> Callable[..., Awaitable[None]]:
        """Faust's wait for every message to be acked (a rebalance, a stop), preceded by the
        fence if the lease lapsed, else by a flush of what is held."""

        async def flush_then_wait_empty(*args: Any, **kwargs: Any) -> None:
            # Each agent over the one lease drops its own: the first to look may be the one
            # that fences, or another agent's hook may have fenced before this one ran.
            self.lease.fence_if_lapsed()
            if self.lease.epoch != self.dropped_epoch:
                self.drop_fenced()
            self.draining = True
            if self.unackable is not None:
                self.let_go_after_failure()  # and those taken since
            try:
                unwritten = self.held or self.flushing is not None
                if not self.in_batch and unwritten and self.lease.held():
                    await self.flush_outside_batch()
                await wait_empty(*args, **kwargs)
            finally:
                self.draining = False

        return flush_then_wait_empty

    # -- failure and fence: what is unwritten is dropped -----------------------------------

    async def _or_fail(self, flush: Awaitable[None]) -> None:
        """A flush outside a batch (between batches, or its acks in the background): a
        failure is said with its traceback and fails the agent."""
        try:
            await flush
        # Any failure: logged with its traceback, writes stop until a restart.
        except Exception as exc:
            log.exception("states not written; their messages stay unacked until a restart")
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """A failure: nothing since the last flush is written or acked, no message after it
        can be acked until a restart (which decides them again), and health says the agent
        crashed (/livez turns red)."""
        self.unackable = self.unackable or exc
        self.drop_unwritten()
        self.worker.health.crashed(exc)
        # Faust acks some of the later messages itself (a batch refused, a stream stopping),
        # and would commit past these: the stream's topics commit nothing more, and Faust
        # stops waiting for their messages (a stop or a rebalance would wait for ever).
        freeze_commits(self.worker.app, self.source_topics)
        self.let_go_after_failure()

    def let_go_after_failure(self) -> None:
        waited_on = stop_waiting_for_topics(self.worker.app, self.source_topics)
        if waited_on:
            log.warning(
                "messages left unacked by the failure: not waited for, nor committed; decided"
                " again after the restart",
                extra={"messages": waited_on, "topics": list(self.source_topics)},
            )

    def drop_unwritten(self) -> None:
        """A failure or a stop mid-batch: drop what was decided since the last flush (states,
        deferred and scope records), its messages left unacked, still held by Faust, so their
        offsets are never committed and the restart decides them again. Unlike `drop_fenced`,
        Faust goes on waiting for them and this worker still owns its partitions, so it
        forgets nothing it cached of them."""
        self.states.drop_unflushed()  # with the states of a flush not written to its end
        if self.flushing is not None:
            self._abandon(self.flushing)
        self.held.clear()
        self.deferred.clear()  # their messages are not acked: decided and sent again
        self.hooks.drop_scope_records()

    def drop_fenced(self) -> None:
        """Fenced: what was decided since the last flush is dropped unwritten, and its
        messages, with those of flushes still awaiting their acks, are released unacked
        (`release`); what this worker cached of its partitions is forgotten. The next owner
        decides them again from the committed offsets and the changelog."""
        self.dropped_epoch = self.lease.epoch
        unacked = self.held + [event for written in self.written for event in written]
        self.drop_unwritten()
        # The partitions may come back in the next generation without Faust calling them
        # revoked: what this worker cached and indexed of them may be stale by then.
        self.states.revoke_all()
        self.release(unacked)

    def release(self, events: list[EventT]) -> None:
        """Let go of `events` unacked: this agent holds them no longer, and Faust stops waiting
        on them (a rebalance goes on without them) and commits none of them. Never acked: the
        partitions' next owner decides them again."""
        dropped = {id(event) for event in events}
        self.held = [event for event in self.held if id(event) not in dropped]
        waited_on = stop_waiting_for(self.worker.app, events)  # Faust waits on these to rebalance
        if waited_on:  # counted once: a batch dropped by the revocation is released again
            log.warning("fenced messages dropped", extra={"messages": waited_on})


class ScopeAgent:
    """An agent over the records of one scope (the conversations, the agent windows): each
    batch is decided under the lease, its decisions sent and acked by the broker within the
    batch, its states written once per commit interval (at once after a signal) and its
    messages acked after the changelog acked them (`write_back`). A subclass says how a batch
    decides (`decide`), what a signal not sent undoes (`settle`) and what idle state goes
    (`evict_idle`)."""

    def __init__(
        self, worker: Worker, states: DecodedStates, table: StateTable, lease: Lease
    ) -> None:
        self.worker = worker
        self.states = states
        self.table = table
        self.lease = lease
        self.write_back = WriteBack(worker, states, table, lease)

    def attach_writes(self, app: faust.App) -> None:
        self.write_back.attach(app)

    async def run_batches(
        self,
        stream: faust.StreamT,
        within: float,
        guard_batch: Callable[[list[EventT]], Awaitable[None]],
    ) -> None:
        await self.write_back.run_batches(stream, within, guard_batch)

    async def guard_batch(self, events: list[EventT]) -> None:
        write_back = self.write_back
        epoch = write_back.hold(events)
        # Decide only under a lease that holds: fenced while waiting, the batch is dropped.
        if not await self.lease.wait(epoch):
            write_back.release(events)
            return
        self.states.begin_batch()
        sends = self.decide(events)
        failed = await send_all(sends)
        if epoch != self.lease.epoch:
            return  # fenced while sending: what it decided is dropped unwritten
        self.settle(sends, failed)
        pointers = self.worker.outbox.pointers_to_unsent(failed)
        for send in await send_all(pointers):
            log.error("dead letter not written", extra={"key": repr(send.kwargs.get("key"))})
        # A batch that sent a signal writes its states at once: a crash before the flush
        # would decide it again and send the same signal twice (harmless, the same id, but
        # as rare as a crash between a send and its write can make it).
        signalled = any(send.decision is not None for send in sends)
        if write_back.flush_due() or (signalled and write_back.held):
            if not await self.lease.wait(epoch):
                return  # fenced: nothing of it written
            await write_back.flush()
        if self.lease.holds(epoch):  # eviction deletes from the changelog: only under the lease
            self.evict_idle(events)
            await self.table.send_pending()  # the tombstones, in order with the states

    def decide(self, events: list[EventT]) -> list[Send]:
        """What the batch's messages send (decisions, dead letters of bad records)."""
        raise NotImplementedError

    def settle(self, sends: list[Send], failed: list[Send]) -> None:
        """Signals acked are sent; a decision whose signal failed is taken back."""
        raise NotImplementedError

    def evict_idle(self, events: list[EventT]) -> None:
        """Delete idle states of the batch's partitions, with bounded work."""
        raise NotImplementedError
