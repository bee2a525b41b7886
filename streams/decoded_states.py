"""Decoded states over a table of encoded ones: each changed state kept in memory and
written once per flush, recent ones cached decoded, idle ones evicted with bounded work.

Where state lives (see docs/design.md, "State follows the source partition"): the table is
declared without `use_partitioner`, so each changelog record goes to the partition of the
message that changed it, the very partition the trace's messages arrive on whatever partitioner
their producer used. Faust's stores and changelog writes find that partition through the stream's
current event, so every read and write here runs inside `event_context(event)` of a message of
the trace's partition; a write outside one crashes the RocksDB store.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any

from faust.streams import current_event

from spanguard.detection.trace_state import StateDecodeError, TraceState
from spanguard.streams.expiry import ExpiryIndex, stored_last_seen
from spanguard.streams.faust_internals import event_context
from spanguard.streams.state_table import StateTable, StateWrite

__all__ = ["EVICT_BUDGET", "DecodedStates"]

log = logging.getLogger(__name__)

# Seconds of a batch eviction may take at most, whatever the store's speed.
EVICT_BUDGET = 0.005
# States `write_some` encodes between two looks at the clock.
WRITES_PER_CLOCK_READ = 8


class DecodedStates(MutableMapping[str, TraceState]):
    """Decoded states (TraceState, or a subclass's: `decode`) by id, over a table of their
    encoded bytes: a MutableMapping[str, TraceState], write-coalescing, with bounded eviction.

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
        # Taken by a flush under way and not written yet (`write_some`), with the event whose
        # partition each goes to: read from here until written.
        self._writing: dict[str, tuple[TraceState, Any]] = {}
        self._expiry: dict[int, ExpiryIndex] = {}
        self._scans: dict[int, Iterator[tuple[bytes, bytes]]] = {}
        self._owned: set[int] = set()
        # Stored states that were no state (truncated, garbage): each started afresh.
        self.unreadable = 0

    # -- partitions coming and going (StateTable calls these) ---------------------------

    def revoke(self, partitions: Iterable[int]) -> None:
        """Forget the indexes of partitions this worker no longer owns."""
        gone = set(partitions)
        if gone and self._batch:
            # Not written: their messages are not acked either, so the partition's next owner
            # decides them again from what the changelog holds.
            for trace_id in [t for t, e in self._event_of.items() if e.message.partition in gone]:
                self._batch.pop(trace_id, None)
                del self._event_of[trace_id]
        if gone and self._writing:
            for trace_id, (_, event) in list(self._writing.items()):
                if event.message.partition in gone:
                    del self._writing[trace_id]
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

    def drop_unflushed(self) -> None:
        """Drop the states changed since the last flush (a batch failed), and those of a flush
        not yet written: nothing of them was written, and their messages must not be acked,
        so they are decided again."""
        self._batch = None
        self._event_of = {}
        self._writing = {}

    @property
    def unflushed(self) -> int:
        """Traces changed since the last flush, or taken by a flush and not yet written."""
        writing = self._writing
        return len(writing) + sum(trace_id not in writing for trace_id in self._batch or ())

    def flush(self) -> None:
        """Write every state changed since the last flush, each once, to the partition of the
        last event that touched it; call it before those events' messages are acked. A
        StateTable that writes directly stores them at once; the flush sends their changelog
        records after (`StateTable.send_pending`)."""
        self.start_flush()
        self.write_some(None)

    def start_flush(self) -> None:
        """Take the states changed since the last flush to be written by `write_some`: until
        written, they are read from there. A flush under way is written to its end first."""
        if self._writing:
            self.write_some(None)
        batch, self._batch = self._batch, None
        events, self._event_of = self._event_of, {}
        self._writing = {
            trace_id: (state, events[trace_id]) for trace_id, state in (batch or {}).items()
        }

    def write_some(self, seconds: float | None) -> bool:
        """Write the taken states, for about `seconds` (all of them with None); True once none
        is left. A state changed again since it was taken is written as it is now: call it
        between batches, never while a batch may hold a decision whose signal is not acked
        (a fired mark written ahead of its signal would be lost with a crash)."""
        writing = self._writing
        deadline = None if seconds is None else time.perf_counter() + seconds
        writes: list[StateWrite] = []
        written: list[tuple[str, TraceState, Any]] = []
        while writing:
            trace_id, (state, event) = writing.popitem()
            writes.append(StateWrite(event, trace_id.encode(), state.to_bytes()))
            written.append((trace_id, state, event))
            # The clock read once in a while: a state's encoding costs microseconds.
            if (
                deadline is not None
                and len(writes) % WRITES_PER_CLOCK_READ == 0
                and time.perf_counter() >= deadline
            ):
                break
        if isinstance(self.table, StateTable) and self.table.writes_directly():
            self.table.put_states(writes)
        else:  # a plain mapping, or Faust's table path, which sends the records itself
            for write in writes:
                with event_context(write.event):
                    self.table[write.key] = write.value
        changed_again = self._batch or {}
        for trace_id, state, event in written:
            self._index(event, trace_id, state.last_seen)
            if trace_id not in changed_again:  # else the next flush keeps it, as written then
                self._keep(event.message.partition, trace_id, state)
        return not writing

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
                    unwritten = self._unwritten(trace_id)
                    if unwritten is not None:  # touched, not yet written
                        index.put(trace_id, self._bucket(unwritten.last_seen))
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

    def _unwritten(self, trace_id: str) -> TraceState | None:
        """The trace's state changed since the last flush, or taken by a flush and not yet
        written: newer than the stored one."""
        if self._batch is not None and trace_id in self._batch:
            return self._batch[trace_id]
        taken = self._writing.get(trace_id)
        return None if taken is None else taken[0]

    def get(self, trace_id: str, default: TraceState | None = None) -> TraceState | None:  # type: ignore[override]
        unwritten = self._unwritten(trace_id)
        if unwritten is not None:
            return unwritten
        event = current_event()
        if event is not None and self._cache:
            # Taken out: the caller changes it in place, and only a flush makes that stored.
            state = self._cache.pop((event.message.partition, trace_id), None)
            if state is not None:
                return state
        data = self.table.get(trace_id.encode())
        if data is None:
            return default
        try:
            return self.decode(data)
        except StateDecodeError as exc:
            # One bad record costs its trace's memory, never the batch: the trace counts afresh.
            self.unreadable += 1
            log.warning(
                "stored state unreadable, started afresh",
                extra={"trace_id": trace_id, "reason": str(exc), "state_bytes": len(data)},
            )
            return default

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
        self._writing.pop(trace_id, None)  # written now, as it is
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
        self._writing.pop(trace_id, None)
        self._forget(trace_id)
        del self.table[trace_id.encode()]

    def __iter__(self) -> Iterator[str]:
        return iter([key.decode() for key in list(self.table.keys())])

    def __len__(self) -> int:
        return len(self.table)
