"""Per-trace state kept as bytes in any mapping: how the core's TraceState lives in a Faust table."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

from spanguard.streams.core import TraceState

__all__ = ["SerializedStates"]


class SerializedStates(MutableMapping[str, TraceState]):
    """A MutableMapping[str, TraceState] over a MutableMapping[bytes, bytes].

    Keys in the backing table are the trace id's ASCII bytes, the very bytes of the input
    messages' keys, so the table's changelog is partitioned like the input. Every assignment
    goes to the table (and its changelog): the core writes each trace it touched once per
    message.
    """

    def __init__(self, table: MutableMapping[bytes, bytes]) -> None:
        self.table = table
        # Between begin_batch() and flush(), states live here and each trace is written to
        # the table (one changelog record) once per batch instead of once per message.
        self._batch: dict[str, TraceState] | None = None

    def begin_batch(self) -> None:
        self._batch = {}

    def flush(self) -> None:
        """Write every state the batch changed; call it before the batch's messages are acked."""
        batch, self._batch = self._batch, None
        for trace_id, state in (batch or {}).items():
            self.table[trace_id.encode()] = state.to_bytes()

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
        if self._batch is not None:
            self._batch[trace_id] = state
        else:
            self.table[trace_id.encode()] = state.to_bytes()

    def __delitem__(self, trace_id: str) -> None:
        if self._batch is not None:
            self._batch.pop(trace_id, None)
        del self.table[trace_id.encode()]

    def __iter__(self) -> Iterator[str]:
        # A snapshot: eviction deletes while iterating.
        return iter([key.decode() for key in list(self.table.keys())])

    def __len__(self) -> int:
        return len(self.table)
