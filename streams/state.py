"""Per-trace state kept as bytes in a Faust table: how the core's TraceState lives in the worker.

Where state lives (see docs/design.md, "State follows the source partition"): the table is
declared without `use_partitioner`, so each changelog record goes to the partition of the
message that changed it, the very partition the trace's messages arrive on whatever partitioner
their producer used. Faust's stores and changelog writes find that partition through the stream's
current event, so every read and write here runs inside `event_context(event)` of a message of
the trace's partition; a write outside one crashes the RocksDB store.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any, NamedTuple

import faust

# The store's and changelog's partition comes from the stream's current event.
from faust.streams import _current_event, current_event
from faust.types import TP, EventT
from faust.types.enums import ProcessingGuarantee

from spanguard.detection.trace_state import TraceState
from spanguard.streams.delivery import Produced, Send, produce, send_all
from spanguard.streams.fence import Lease

if TYPE_CHECKING:
    from spanguard.streams.wiring import Worker

__all__ = [
    "CHANGELOG_ACK_TIMEOUT",
    "EVICT_BUDGET",
    "FLUSH_CHECK_INTERVAL",
    "ExpiryIndex",
    "ScopeAgent",
    "SerializedStates",
    "StateWrite",
    "TraceTable",
    "WriteBackAgent",
    "event_context",
]

log = logging.getLogger("spanguard.worker")

# Seconds of a batch eviction may take at most, whatever the store's speed.
EVICT_BUDGET = 0.005
# Seconds between two looks of the flush timer (a due flush waits at most this long when idle).
FLUSH_CHECK_INTERVAL = 0.1
# Seconds a flush waits for its changelog acks on a stop, before leaving them unacked (decided
# again after the restart); running, it waits as long as the lease holds.
CHANGELOG_ACK_TIMEOUT = 10.0


@contextlib.contextmanager
def event_context(event: Any) -> Iterator[None]:
    """Make `event` the stream's current event, as Faust does while an agent handles it."""
    token = _current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        _current_event.reset(token)


# TraceState.to_bytes writes last_seen as its last key; inside a string the quotes would be
# escaped, so the last match is the key. Eviction reads it without decoding the whole state.
_LAST_SEEN = b'"last_seen":'


def stored_last_seen(data: bytes) -> float:
    """The last_seen of a stored state; one that cannot be read counts as long idle."""
    at = data.rfind(_LAST_SEEN)
    if at >= 0:
        with contextlib.suppress(ValueError):
            return float(data[at + len(_LAST_SEEN) :].rstrip(b"}"))
    try:
        return float(json.loads(data)["last_seen"])
    except (ValueError, TypeError, KeyError):
        return 0.0


class ExpiryIndex:
    """One partition's trace ids in buckets of `bucket_seconds` by last_seen.

    Plain dicts of str keys and None or int values, and a heap of ints: CPython's cyclic
    garbage collector does not track or walk them, so a million entries cost no GC pause (an
    OrderedDict or a heap of tuples of that size would: docs/performance.md, "Figures behind the
    code").
    """

    __slots__ = ("bucket_of", "buckets", "order")

    def __init__(self) -> None:
        self.bucket_of: dict[str, int] = {}
        self.buckets: dict[int, dict[str, None]] = {}
        self.order: list[int] = []  # heap of the bucket numbers in `buckets`

    def put(self, trace_id: str, bucket: int) -> None:
        old = self.bucket_of.get(trace_id)
        if old == bucket:
            return
        if old is not None and old in self.buckets:
            self.buckets[old].pop(trace_id, None)
        self.bucket_of[trace_id] = bucket
        members = self.buckets.get(bucket)
        if members is None:
            members = self.buckets[bucket] = {}
            heapq.heappush(self.order, bucket)
        members[trace_id] = None

    def pop_before(self, bucket: int) -> str | None:
        """Remove and return a trace id of the oldest bucket numbered below `bucket`."""
        while self.order and self.order[0] < bucket:
            members = self.buckets[self.order[0]]
            if members:
                trace_id = members.popitem()[0]
                del self.bucket_of[trace_id]
                return trace_id
            del self.buckets[heapq.heappop(self.order)]
        return None

    def __contains__(self, trace_id: object) -> bool:
        return trace_id in self.bucket_of


class StateWrite(NamedTuple):
    """One state to write: its key and encoded value, and the event whose partition it goes to."""

    event: Any
    key: bytes
    value: bytes


class SerializedStates(MutableMapping[str, TraceState]):
    """A MutableMapping[str, TraceState] over the table, write-coalescing, with bounded eviction.

    Between begin_batch() and flush(), states live in memory and each trace is written to the
    table (one changelog record) once per flush, in the context of the last event that touched
    it. The worker flushes once per commit interval, not per batch (docs/design.md, "State
    writes once per commit"), and holds its messages' acks until then, as Kafka Streams'
    record cache does: a trace touched by many records between two commits costs one
    changelog record. Eviction reads no more than a bounded number of entries per batch (see docs/design.md,
    "Eviction") from an expiry index per owned partition, which holds the traces this worker
    wrote (indexed as it writes them) and those it found in the store when the partition was
    assigned (from the changelog or its local disk, indexed a few per batch by a scan). An
    index entry is only a hint: before deleting, the stored state's own last_seen is read, so
    a trace touched since (by another worker while the partition was away) is kept.
    A trace is evicted once the whole bucket it is in is older than the cutoff: at most
    `bucket_seconds` late.

    Decoded states of the owned partitions are kept (up to `cache_size`, least recently used
    dropped first), so a trace's next message skips the store's read and the decode; the table
    and its changelog are still written once per flush. A cached state is exactly what the
    batch that last wrote it wrote: a read takes it out of the cache (the guard changes it in
    place), and only flush() puts it back, after its write. States changed since the last flush
    are read from the unflushed states first; if the process dies before the flush, the cache
    and those states die with it. A revoked
    partition's cached states are dropped with its index (another worker may change them while
    it is away), and an evicted trace's with its stored state.
    """

    def __init__(
        self,
        table: MutableMapping[bytes, bytes],
        bucket_seconds: float = 60.0,
        cache_size: int = 0,
        decode: Callable[[bytes], TraceState] = TraceState.from_bytes,
    ) -> None:
        self.table = table
        self.decode = decode  # a subclass's from_bytes (the conversation table's states)
        self.bucket_seconds = bucket_seconds
        self.cache_size = cache_size
        # (partition, trace id) -> state as written, oldest use first. Keyed by partition like
        # the store, which keeps one state per partition for a trace id arriving on several.
        self._cache: OrderedDict[tuple[int, str], TraceState] = OrderedDict()
        # Changed since the last flush (None: no flush window open).
        self._batch: dict[str, TraceState] | None = None
        self._event_of: dict[str, Any] = {}
        self._expiry: dict[int, ExpiryIndex] = {}
        self._scans: dict[int, Iterator[tuple[bytes, bytes]]] = {}
        self._owned: set[int] = set()

    # -- partitions coming and going (TraceTable calls these) ---------------------------

    def revoke(self, partitions: Iterable[int]) -> None:
        """Forget the indexes of partitions this worker no longer owns."""
        gone = set(partitions)
        if gone and self._batch:
            # Not written: their messages are not acked either, so the partition's next owner
            # decides them again from what the changelog holds.
            for trace_id in [t for t, e in self._event_of.items() if e.message.partition in gone]:
                self._batch.pop(trace_id, None)
                del self._event_of[trace_id]
        for partition in gone:
            self._owned.discard(partition)
            self._expiry.pop(partition, None)
            self._scans.pop(partition, None)
        if gone and self._cache:
            for key in [key for key in self._cache if key[0] in gone]:
                del self._cache[key]

    def revoke_all(self) -> None:
        """Forget every partition, as if all were revoked: for a worker fenced out of the
        group, which may get its partitions back in the next generation without Faust seeing
        them revoked, after another worker changed their traces."""
        self.revoke(set(self._owned) | set(self._expiry) | {key[0] for key in self._cache})

    def assigned(self, partition: int, stored: Iterator[tuple[bytes, bytes]]) -> None:
        """A partition is now owned: its stored traces are indexed lazily, from `stored`."""
        if partition in self._owned:
            return  # kept through the rebalance: its index is still right
        self._owned.add(partition)
        self._scans[partition] = stored

    @property
    def scanning(self) -> int:
        """Partitions whose stored traces are not all indexed yet."""
        return len(self._scans)

    @property
    def cached(self) -> int:
        """Decoded states kept in memory."""
        return len(self._cache)

    def indexed(self) -> int:
        """Traces in the expiry indexes of the owned partitions: every stored trace once the
        scans are done. Counted without reading the store (a RocksDB table's len() reads
        every key), so /metrics can ask for it on every scrape."""
        return sum(len(index.bucket_of) for index in self._expiry.values())

    # -- batches ------------------------------------------------------------------------

    def begin_batch(self) -> None:
        """Open a flush window, or go on with the one open: states changed since the last
        flush stay in memory until the next."""
        if self._batch is None:
            self._batch = {}
            self._event_of = {}

    def discard(self) -> None:
        """Drop the states changed since the last flush (a batch failed): nothing of them was
        written, and their messages must not be acked, so they are decided again."""
        self._batch = None
        self._event_of = {}

    @property
    def unflushed(self) -> int:
        """Traces changed since the last flush."""
        return len(self._batch or ())

    def flush(self) -> None:
        """Write every state changed since the last flush, each once, to the partition of the
        last event that touched it; call it before those events' messages are acked. A
        TraceTable that writes directly stores them at once; the flush sends their changelog
        records after (`TraceTable.send_pending`)."""
        batch, self._batch = self._batch, None
        events, self._event_of = self._event_of, {}
        writes = [
            StateWrite(events[trace_id], trace_id.encode(), state.to_bytes())
            for trace_id, state in (batch or {}).items()
        ]
        if isinstance(self.table, TraceTable) and self.table.writes_directly():
            self.table.put_states(writes)
        else:  # a plain mapping, or Faust's table path, which sends the records itself
            for write in writes:
                with event_context(write.event):
                    self.table[write.key] = write.value
        for trace_id, state in (batch or {}).items():
            event = events[trace_id]
            self._index(event, trace_id, state.last_seen)
            self._keep(event.message.partition, trace_id, state)

    def _keep(self, partition: int, trace_id: str, state: TraceState) -> None:
        if self.cache_size <= 0:
            return
        self._cache[(partition, trace_id)] = state
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def evict_idle(
        self, events: list[Any], cutoff: float, limit: int, budget: float = EVICT_BUDGET
    ) -> int:
        """Delete traces last seen before `cutoff`, in the partitions of `events`.

        At most `limit` stored traces are scanned into the index and `limit` index entries
        examined, whatever the size of the table, and no more once `budget` seconds are
        spent (half of them at most on the scan): a slow disk cannot stretch a batch."""
        start = time.perf_counter()
        below = self._bucket(cutoff)  # buckets numbered below it are wholly before the cutoff
        self._scan(limit, start + budget / 2, below - 1)
        deadline = start + budget
        evicted = examined = 0
        last_of_partition = {event.message.partition: event for event in events}
        for partition, event in last_of_partition.items():
            index = self._expiry.get(partition)
            if index is None:
                continue
            with event_context(event):
                while examined < limit and time.perf_counter() < deadline:
                    trace_id = index.pop_before(below)
                    if trace_id is None:
                        break
                    examined += 1
                    if self._batch and trace_id in self._batch:  # touched, not yet flushed
                        index.put(trace_id, self._bucket(self._batch[trace_id].last_seen))
                        continue
                    key = trace_id.encode()
                    data = self.table.get(key)
                    if data is None:
                        continue  # deleted since it was indexed
                    last_seen = stored_last_seen(data)
                    if last_seen >= cutoff:  # touched since: index it by its own last_seen
                        index.put(trace_id, self._bucket(last_seen))
                        continue
                    del self.table[key]
                    self._cache.pop((partition, trace_id), None)
                    evicted += 1
        return evicted

    def _bucket(self, last_seen: float) -> int:
        return int(last_seen // self.bucket_seconds)

    def _scan(self, limit: int, deadline: float, overdue: int) -> None:
        """Index up to `limit` more stored traces of newly owned partitions, until `deadline`.

        Traces idle already all go to the `overdue` bucket: however old they are, they make
        one bucket, not one per `bucket_seconds` of their age."""
        left = limit
        for partition in list(self._scans):
            stored = self._scans[partition]
            index = self._expiry.setdefault(partition, ExpiryIndex())
            for key, data in stored:
                trace_id = key.decode(errors="replace")
                if trace_id not in index:  # else written since: that entry is newer
                    index.put(trace_id, max(self._bucket(stored_last_seen(data)), overdue))
                left -= 1
                if left <= 0 or time.perf_counter() >= deadline:
                    return
            del self._scans[partition]  # every stored trace of it is indexed

    def _index(self, event: Any, trace_id: str, last_seen: float) -> None:
        index = self._expiry.setdefault(event.message.partition, ExpiryIndex())
        index.put(trace_id, self._bucket(last_seen))

    # -- the mapping --------------------------------------------------------------------

    def __getitem__(self, trace_id: str) -> TraceState:
        state = self.get(trace_id)
        if state is None:
            raise KeyError(trace_id)
        return state

    def get(self, trace_id: str, default: TraceState | None = None) -> TraceState | None:  # type: ignore[override]
        if self._batch is not None and trace_id in self._batch:
            return self._batch[trace_id]
        event = current_event()
        if event is not None and self._cache:
            # Taken out: the caller changes it in place, and only a flush makes that stored.
            state = self._cache.pop((event.message.partition, trace_id), None)
            if state is not None:
                return state
        data = self.table.get(trace_id.encode())
        return default if data is None else self.decode(data)

    def __setitem__(self, trace_id: str, state: TraceState) -> None:
        event = current_event()
        # Outside an event (a retraction after a failed send) a trace of the batch keeps the
        # event that brought it in: its write goes to that message's partition.
        if self._batch is not None and (event is not None or trace_id in self._event_of):
            self._batch[trace_id] = state
            if event is not None:
                self._event_of[trace_id] = event
            return
        self.table[trace_id.encode()] = state.to_bytes()
        self._forget(trace_id)
        if event is not None:
            self._index(event, trace_id, state.last_seen)

    def _forget(self, trace_id: str) -> None:
        """Drop the cached states of a trace id, in any partition."""
        if self._cache:
            for key in [key for key in self._cache if key[1] == trace_id]:
                del self._cache[key]

    def __delitem__(self, trace_id: str) -> None:
        if self._batch is not None:
            self._batch.pop(trace_id, None)
            self._event_of.pop(trace_id, None)
        self._forget(trace_id)
        del self.table[trace_id.encode()]

    def __iter__(self) -> Iterator[str]:
        return iter([key.decode() for key in list(self.table.keys())])

    def __len__(self) -> int:
        return len(self.table)


def store_write_batch(store: Any) -> Any:
    """An empty write batch of Faust's RocksDB store, of whichever binding it runs on."""
    if store.use_rocksdict:
        import rocksdict

        return rocksdict.WriteBatch(raw_mode=True)
    import rocksdb  # type: ignore[import-not-found]

    return rocksdb.WriteBatch()


def stored_items(store: Any, partition: int) -> Iterator[tuple[bytes, bytes]]:
    """The (key, value) pairs a Faust store holds for one partition, read lazily.

    Faust has no public per-partition iterator; these are the stores' own members
    (faust-streaming 0.15): RocksDB keeps a database per partition, the memory store the
    partition of every key it recovered from the changelog."""
    if hasattr(store, "_db_for_partition"):
        yield from store._visible_items(store._db_for_partition(partition))
        return
    keys = [key for key, owner in store._key_partition.items() if owner == partition]
    for key in keys:
        value = store.data.get(key)
        if value is not None:
            yield key, value


class TraceTable(faust.Table):
    """The state table: tells its SerializedStates when partitions come and go.

    A revoked partition's indexes are dropped (another worker may change its traces while it
    is away); a partition owned after recovery is indexed from what the store holds, the
    traces recovered from the changelog and those already on local disk."""

    states: SerializedStates | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        # Changelog records sent and not yet handed to whoever waits for their acks.
        self.unconfirmed: list[Any] = []
        # Changelog records (partition, key, value or None) stored and not yet sent.
        self.pending: list[tuple[int, bytes, bytes | None]] = []

    def send_changelog(self, *args: Any, **kwargs: Any) -> Any:
        """Keep each changelog record's future: the span agent waits for the broker's ack of
        a flush's writes before it lets their messages' offsets be committed."""
        future = super().send_changelog(*args, **kwargs)
        self.unconfirmed.append(future)
        return future

    def writes_directly(self) -> bool:
        """At least once on a RocksDB store, changelog records are sent straight to the
        producer, in order, from `pending`, and a flush's states stored in one write batch per
        partition: Faust's own path (a send through its buffer and a persisted offset per
        record) costs several times as much per state, before its send and after, while every batch
        waited (docs/performance.md). In Kafka transactions (exactly once) the transaction's
        producer must send them, so Faust's path does."""
        # (Faust's setting descriptor types the value as the enum class; it is a member.)
        guarantee: ProcessingGuarantee = self.app.conf.processing_guarantee  # type: ignore[assignment]
        return guarantee is ProcessingGuarantee.AT_LEAST_ONCE and hasattr(
            self.data, "_db_for_partition"
        )

    def on_key_set(self, key: Any, value: Any) -> None:
        if not self.writes_directly():
            super().on_key_set(key, value)
            return
        # Declared without use_partitioner, the table names the arriving record's partition.
        self.pending.append((self.partition_for_key(key), key, value))  # type: ignore[arg-type]

    def on_key_del(self, key: Any) -> None:
        if not self.writes_directly():
            super().on_key_del(key)
            return
        self.pending.append((self.partition_for_key(key), key, None))  # type: ignore[arg-type]

    def put_states(self, writes: list[StateWrite]) -> None:
        """Store a flush's states, their changelog records left in `pending` (when
        `writes_directly`)."""
        store: Any = self.data  # a RocksDB store (writes_directly): its private index and DBs
        batches: dict[int, Any] = {}
        for write in writes:
            partition = write.event.message.partition
            batch = batches.get(partition)
            if batch is None:
                batch = batches[partition] = store_write_batch(store)
            batch.put(write.key, write.value)
            store._key_index[write.key] = partition
            self.pending.append((partition, write.key, write.value))
        for partition, batch in batches.items():
            store._db_for_partition(partition).write(batch)

    async def send_pending(self) -> None:
        """Send the changelog records of what was stored since the last call, in the order it
        was stored: the same bytes to the same partition as Faust's path; each record's ack is
        kept for the flush to await, and the last of each partition's, once acked, is the
        store's persisted offset (recovery reads the changelog after it), as Faust keeps."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        producer, topic = self.app.producer, self.changelog_topic.get_topic_name()
        last: dict[int, Any] = {}
        for partition, key, value in pending:
            future = await producer.send(topic, key, value, partition, None, None)
            self.unconfirmed.append(future)
            last[partition] = future
        for future in last.values():
            future.add_done_callback(self._persist_offset)

    def _persist_offset(self, future: asyncio.Future[Any]) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # the flush raises; recovery reads from the last offset persisted
        metadata = future.result()
        self.data.set_persisted_offset(metadata.topic_partition, metadata.offset)

    def take_unconfirmed(self) -> list[Any]:
        """The changelog records sent since the last call (their futures)."""
        taken, self.unconfirmed = self.unconfirmed, []
        return taken

    async def on_rebalance(
        self, assigned: set[TP], revoked: set[TP], newly_assigned: set[TP], generation_id: int = 0
    ) -> None:
        await super().on_rebalance(assigned, revoked, newly_assigned, generation_id)
        if self.states is not None:
            # Any revoked topic of a partition drops its index: at worst a rescan, never stale.
            self.states.revoke({tp.partition for tp in revoked})

    async def on_recovery_completed(self, active_tps: set[TP], standby_tps: set[TP]) -> None:
        await super().on_recovery_completed(active_tps, standby_tps)
        if self.states is not None:
            for partition in sorted({tp.partition for tp in active_tps}):
                self.states.assigned(partition, stored_items(self.data, partition))


class WriteBackAgent:
    """An agent over a SerializedStates table whose messages are held until the states they
    changed are written and acked by the changelog (docs/design.md, "State writes once per
    commit"): the span agent over the trace table, the conversation agent and the agent-windows
    agent over theirs, each with its own held messages, flush timer and failure, under the
    worker's one lease on its partitions (streams/fence.py). The flush also awaits the acks of
    the records an agent deferred (`defer`): their messages are acked after them.

    A subclass runs its batches through `run_batches` and, in each batch, takes its messages
    with `hold`, opens the flush window (`states.begin_batch()`), and flushes at its end once
    `flush_due()`; `attach_writes` registers the flush timer and the flush before Faust waits
    for every message to be acked (a rebalance, a stop)."""

    def __init__(
        self, worker: Worker, states: SerializedStates, table: TraceTable, lease: Lease
    ) -> None:
        self.worker = worker
        self.states = states
        self.table = table
        self.lease = lease
        # Events whose changed states are not written yet: each holds its message's ack.
        self.held: list[EventT] = []
        # Events whose states are written, waiting for the changelog's acks (one list per flush).
        self.confirming: list[list[EventT]] = []
        self.flushed_at = time.monotonic()
        self.in_batch = False
        self.draining = False  # Faust waits for every message to be acked: flush at once
        # A failure (a batch that raised, a flush that failed) left messages that can never be
        # acked, so no offset after them would be committed: every batch after it fails too,
        # loudly, until the restart decides them again (health: crashed, then /livez red).
        self.unackable: BaseException | None = None
        # The lease's last fenced epoch whose unwritten states this agent has dropped.
        self.dropped_epoch = lease.epoch
        # Records produced since the last flush whose acks it awaits before acking `held`.
        self.deferred: list[tuple[Send, Produced]] = []
        # Held records (`take_held_records`) are produced under it, in the order they were
        # taken: the agent-window agent drops a row older than one it already counted.
        self.producing = asyncio.Lock()
        # Flushes whose acks are awaited by a task of their own (`flush_states`).
        self.acking: set[asyncio.Future[None]] = set()

    def attach_writes(self, app: faust.App) -> None:
        app.timer(interval=FLUSH_CHECK_INTERVAL)(self.flush_when_idle)
        # A rebalance and a stop both wait, in App._consumer_wait_empty, until every message
        # taken is acked, with timers already stopped on a stop: the held messages are flushed
        # first (a batch still running flushes as it ends), so neither waits out the interval
        # or forever. A worker whose lease lapsed writes nothing more: the partitions may be
        # another's already.
        app._consumer_wait_empty = self._flushing_first(app._consumer_wait_empty)  # type: ignore[method-assign, assignment]

    # -- batches ---------------------------------------------------------------------------

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
        crashed = False
        try:
            # (take_events is Stream's, not on the StreamT interface Faust types it by.)
            batches = stream.take_events(self.worker.settings.batch_size, within=within)  # type: ignore[attr-defined]
            async for events in batches:
                self.in_batch = True
                await guard_batch(events)
                self.in_batch = False
                progressed()
        except BaseException as exc:
            crashed = self.stopped_mid_batch(exc)
            raise
        finally:
            if self.held and not crashed and self.lease.held():
                await self.flush_on_stop()

    def hold(self, events: list[EventT]) -> int:
        """Take a batch's messages: each holds its ack until the flush that writes its states.
        Returns the lease epoch the batch was fetched under."""
        if self.unackable is not None:
            raise RuntimeError(f"messages left unacked by an earlier failure: {self.unackable!r}")
        for event in events:
            event.message.incref()  # acked by flush_states, once its states are written
        self.held.extend(events)
        return self.lease.epoch

    def stopped_mid_batch(self, exc: BaseException) -> bool:
        """Stopped or failed, maybe mid-batch with kills not yet acked: that batch's states
        (fired marks among them) are not written, decided again on restart. True if failed."""
        cut_short, self.in_batch = self.in_batch, False
        crashed = not isinstance(exc, asyncio.CancelledError)
        if crashed:
            self.unackable = self.unackable or exc
            self.give_up(exc)
        elif cut_short:
            self.discard_unwritten()
        return crashed

    # -- writing states, then acking -------------------------------------------------------

    async def flush_states(
        self, ack_timeout: float | None = None, *, acks_in_background: bool = False
    ) -> None:
        """Write the states changed since the last flush and, once the changelog has acked
        them and the broker the records deferred since the last flush, let their messages be
        acked: no offset is committed ahead of its state or of a record it sent.

        `acks_in_background`: return once the writes and records are handed to the producer,
        the acks awaited (and the messages acked) by a task of their own, so the batch after
        does not wait out the changelog's round trip (`acking`). A failure there is the
        agent's failure, as a flush between batches is."""
        epoch = self.lease.epoch
        self.states.flush()
        self.flushed_at = time.monotonic()
        # The messages, the records they deferred and those they hold, taken together: no
        # batch can add to one of them and not the others in between.
        written = self.held.copy()
        self.held.clear()
        records, self.deferred = self.deferred, []
        held_records = self.take_held_records()
        self.confirming.append(written)
        try:
            if held_records:
                async with self.producing:
                    produced = await produce(held_records)
                records.extend(zip(held_records, produced, strict=True))
            await self.table.send_pending()
            changelog = self.table.take_unconfirmed()
        except BaseException:
            self.confirming = [batch for batch in self.confirming if batch is not written]
            raise
        if not acks_in_background:
            await self.ack_when_written(written, changelog, records, epoch, ack_timeout)
            return
        task = asyncio.ensure_future(self.acking_in_background(written, changelog, records, epoch))
        self.acking.add(task)
        task.add_done_callback(self.acking.discard)

    async def ack_when_written(
        self,
        written: list[EventT],
        changelog: list[Awaitable[Any]],
        records: list[tuple[Send, Produced]],
        epoch: int,
        ack_timeout: float | None,
    ) -> None:
        """Ack a flush's messages once its changelog writes and records are acked."""
        try:
            unsent = await self.writes_acked(changelog, records, epoch, ack_timeout)
            if unsent is None:
                return  # fenced meanwhile (the revocation released them) or stopping
            if unsent:
                await self.dead_letter_deferred(unsent)
                if epoch != self.lease.epoch:
                    return
        finally:
            self.confirming = [batch for batch in self.confirming if batch is not written]
        for event in written:
            event.ack()  # our reference; the take buffer acked its own after the batch

    async def acking_in_background(
        self,
        written: list[EventT],
        changelog: list[Awaitable[Any]],
        records: list[tuple[Send, Produced]],
        epoch: int,
    ) -> None:
        try:
            await self.ack_when_written(written, changelog, records, epoch, None)
        # A background task: any failure goes to flush_failed (logged with its traceback, writes stop).
        except Exception as exc:  # noqa: BLE001
            self.flush_failed(exc)

    async def writes_acked(
        self,
        writes: list[Awaitable[Any]],
        records: list[tuple[Send, Produced]],
        epoch: int,
        # None or a deadline the loop checks between acks, as flush_states passes it.
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

    def take_held_records(self) -> list[Send]:
        """Records the agent held back to send together (the span agent's scope records),
        taken to be sent now; none by default."""
        return []

    def forget_held_records(self) -> None:
        """Their messages will not be acked (a fence, a failure): the held records go too."""

    async def send_held_records(self) -> None:
        """Send the held records before the flush would: produced in the order taken, their
        acks awaited by the next flush with the messages they came from."""
        epoch = self.lease.epoch
        async with self.producing:
            sends = self.take_held_records()
            if sends:
                produced = await produce(sends)
                if epoch == self.lease.epoch:  # fenced meanwhile: dropped with their messages
                    self.defer(sends, produced)

    def defer(self, sends: list[Send], produced: list[Produced]) -> None:
        """Records produced without waiting for the broker: the next flush awaits their acks
        before it acks the messages held with them."""
        self.deferred.extend(zip(sends, produced, strict=True))

    async def dead_letter_deferred(self, unsent: list[tuple[Send, BaseException]]) -> None:
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
        self.count_dead_letters(len(pointers))
        lost = await send_all(pointers)
        if lost:
            raise RuntimeError(
                f"{len(lost)} dead letters of records not written could not be written either"
            )

    def count_dead_letters(self, pointers: int) -> None:
        """Told of the dead letters left for records not written (a subclass counts them)."""

    def flush_due(self) -> bool:
        due = time.monotonic() - self.flushed_at >= self.worker.settings.commit_interval
        return bool(self.held) and (due or self.draining)

    async def flush_between_batches(self) -> None:
        try:
            await self.flush_states()
        # Any failure goes to flush_failed (logged with its traceback, writes stop until a restart).
        except Exception as exc:  # noqa: BLE001
            self.flush_failed(exc)

    def flush_failed(self, exc: Exception) -> None:
        """A flush outside a batch failed (between batches, or its acks in the background):
        said with its traceback, and no message after it can be acked until a restart."""
        log.exception("states not written; their messages stay unacked until a restart")
        self.unackable = exc
        self.give_up(exc)

    def give_up(self, exc: BaseException) -> None:
        """Nothing since the last flush is written or acked: decided again on restart."""
        self.discard_unwritten()
        self.worker.health.crashed(exc)

    def discard_unwritten(self) -> None:
        self.states.discard()
        self.held.clear()
        self.deferred.clear()  # their messages are not acked: decided and sent again
        self.forget_held_records()

    async def flush_when_idle(self) -> None:
        # Between batches only: a batch's retractions write to states it has open. Not on a
        # lapsed lease: the flush waits for the renewal, or is dropped by the fence.
        if not self.in_batch and self.flush_due() and self.lease.held():
            await self.flush_between_batches()

    async def flush_on_stop(self) -> None:
        """Stopping: what was decided is written, its changelog acks awaited a bounded time
        (and those of earlier flushes still awaited in the background)."""
        try:
            await self.flush_states(ack_timeout=CHANGELOG_ACK_TIMEOUT)
        except Exception as exc:  # not committed: decided again after the restart  # noqa: BLE001
            log.warning("states not flushed on stop", extra={"error": repr(exc)})
        if self.acking:
            await asyncio.wait(set(self.acking), timeout=CHANGELOG_ACK_TIMEOUT)

    # -- the lease -------------------------------------------------------------------------

    def drop_unwritten(self) -> None:
        """Fenced: what was decided since the last flush is not written and its messages are
        not acked (nor left for Faust to wait on): the next owner decides them again from the
        committed offsets and the changelog."""
        self.dropped_epoch = self.lease.epoch
        self.states.discard()
        self.deferred.clear()  # never awaited: nothing they came from is acked
        self.forget_held_records()
        # The partitions may come back in the next generation without Faust calling them
        # revoked: what this worker cached and indexed of them may be stale by then.
        self.states.revoke_all()
        self.release(self.held + [event for written in self.confirming for event in written])

    def release(self, events: list[EventT]) -> None:
        """Let go of `events` unacked: Faust stops waiting on them and commits none of them."""
        dropped = {id(event) for event in events}
        self.held = [event for event in self.held if id(event) not in dropped]
        consumer: Any = self.worker.app.consumer  # the driver's; ConsumerT types no private state
        unacked = consumer._unacked_messages  # Faust waits on these to rebalance
        waited_on = [event for event in events if event.message in unacked]
        for event in waited_on:
            unacked.discard(event.message)
        if waited_on:  # counted once: a batch dropped by the revocation is released again
            log.warning("fenced messages dropped", extra={"messages": len(waited_on)})

    def _flushing_first(
        self, wait_empty: Callable[..., Awaitable[None]]
    ) -> Callable[..., Awaitable[None]]:
        async def flush_then_wait_empty(*args: Any, **kwargs: Any) -> None:
            # Each agent over the one lease drops its own: the first to look may be the one
            # that fences, or another agent's hook may have fenced before this one ran.
            self.lease.fence_if_lapsed()
            if self.lease.epoch != self.dropped_epoch:
                self.drop_unwritten()
            self.draining = True
            try:
                if not self.in_batch and self.held and self.lease.held():
                    await self.flush_between_batches()
                await wait_empty(*args, **kwargs)
            finally:
                self.draining = False

        return flush_then_wait_empty


class ScopeAgent(WriteBackAgent):
    """An agent over the records of one scope (the conversations, the agent windows): each
    batch is decided under the lease, its decisions sent and acked by the broker within the
    batch, its states written once per commit interval (at once after a signal) and its
    messages acked after the changelog acked them. A subclass says how a batch decides
    (`decide`), what a signal not sent undoes (`settle`) and what idle state goes
    (`evict_idle`)."""

    async def guard_batch(self, events: list[EventT]) -> None:
        epoch = self.hold(events)
        # Decide only under a lease that holds: fenced while waiting, the batch is dropped.
        if not await self.lease.wait(epoch):
            self.release(events)
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
        if self.flush_due() or (signalled and self.held):
            if not await self.lease.wait(epoch):
                return  # fenced: nothing of it written
            await self.flush_states()
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
