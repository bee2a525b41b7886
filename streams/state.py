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

    def __getitem__(self, trace_id: str) -> TraceState:
        data = self.table.get(trace_id.encode())
        if data is None:
            raise KeyError(trace_id)
        return TraceState.from_bytes(data)

    def get(self, trace_id: str, default: TraceState | None = None) -> TraceState | None:  # type: ignore[override]
        data = self.table.get(trace_id.encode())
        return default if data is None else TraceState.from_bytes(data)

    def __setitem__(self, trace_id: str, state: TraceState) -> None:
        self.table[trace_id.encode()] = state.to_bytes()

    def __delitem__(self, trace_id: str) -> None:
        del self.table[trace_id.encode()]

    def __iter__(self) -> Iterator[str]:
        # A snapshot: eviction deletes while iterating.
        return iter([key.decode() for key in list(self.table.keys())])

    def __len__(self) -> int:
        return len(self.table)
