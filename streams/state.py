"""Per-trace state kept as bytes in a Faust table: how the core's TraceState lives in the worker.

Where state lives (see docs/design.md, "State follows the source partition"): the table is
declared without `use_partitioner`, so each changelog record goes to the partition of the
message that changed it, the very partition the trace's messages arrive on whatever partitioner
their producer used. Faust's stores and changelog writes find that partition through the stream's
current event, so every read and write here runs inside `event_context(event)` of a message of
the trace's partition; a write outside one is what crashed the RocksDB store before.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from typing import Any

# The store's and changelog's partition comes from the stream's current event.
from faust.streams import _current_event, current_event

from spanguard.detection.guard import TraceState

__all__ = ["SerializedStates", "event_context"]


@contextlib.contextmanager
def event_context(event: Any) -> Iterator[None]:
    """Make `event` the stream's current event, as Faust does while an agent handles it."""
    token = _current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        _current_event.reset(token)


class SerializedStates(MutableMapping[str, TraceState]):
    """A MutableMapping[str, TraceState] over the table, batched, with bounded eviction.

    Between begin_batch() and flush(), states live in memory and each trace is written to the
    table (one changelog record) once per batch, in the context of the last event that touched
    it. An expiry index per partition (trace ids in order of last touch) lets eviction delete
    the oldest few traces per batch without reading the rest: bounded work per tick.
    """

    def __init__(self, table: MutableMapping[bytes, bytes]) -> None:
        self.table = table
        self._batch: dict[str, TraceState] | None = None
        self._event_of: dict[str, Any] = {}
        self._expiry: dict[int, OrderedDict[str, float]] = {}

    def begin_batch(self) -> None:
        self._batch = {}
        self._event_of = {}

    def flush(self) -> None:
        """Write every state the batch changed; call it before the batch's messages are acked."""
        batch, self._batch = self._batch, None
        events, self._event_of = self._event_of, {}
        for trace_id, state in (batch or {}).items():
            event = events[trace_id]
            with event_context(event):
                self.table[trace_id.encode()] = state.to_bytes()
            self._index(event, trace_id, state.last_seen)

    def evict_idle(self, events: list[Any], cutoff: float, limit: int) -> int:
        """Delete up to `limit` traces last seen before `cutoff`, in the partitions of `events`."""
        evicted = 0
        last_of_partition = {event.message.partition: event for event in events}
        for partition, event in last_of_partition.items():
            index = self._expiry.get(partition)
            with event_context(event):
                while index and evicted < limit:
                    trace_id, last_seen = next(iter(index.items()))
                    if last_seen >= cutoff:
                        break
                    del index[trace_id]
                    with contextlib.suppress(KeyError):
                        del self.table[trace_id.encode()]
                    evicted += 1
        return evicted

    def _index(self, event: Any, trace_id: str, last_seen: float) -> None:
        index = self._expiry.setdefault(event.message.partition, OrderedDict())
        index[trace_id] = last_seen
        index.move_to_end(trace_id)

    def __getitem__(self, trace_id: str) -> TraceState:
        state = self.get(trace_id)
        if state is None:
            raise KeyError(trace_id)
        return state

    def get(self, trace_id: str, default: TraceState | None = None) -> TraceState | None:  # type: ignore[override]
        if self._batch is not None and trace_id in self._batch:
            return self._batch[trace_id]
        data = self.table.get(trace_id.encode())
        return default if data is None else TraceState.from_bytes(data)

    def __setitem__(self, trace_id: str, state: TraceState) -> None:
        event = current_event()
        if self._batch is not None:
            self._batch[trace_id] = state
            self._event_of[trace_id] = event
        else:
            self.table[trace_id.encode()] = state.to_bytes()
            if event is not None:
                self._index(event, trace_id, state.last_seen)

    def __delitem__(self, trace_id: str) -> None:
        if self._batch is not None:
            self._batch.pop(trace_id, None)
            self._event_of.pop(trace_id, None)
        del self.table[trace_id.encode()]

    def __iter__(self) -> Iterator[str]:
        return iter([key.decode() for key in list(self.table.keys())])

    def __len__(self) -> int:
        return len(self.table)
