"""Which traces may be idle: an expiry index per owned partition, and a stored state's
last_seen read without decoding it (docs/design.md, "Eviction")."""

from __future__ import annotations

import contextlib
import heapq
import json

from spanguard.detection.trace_state import stored_state_last_seen

__all__ = ["ExpiryIndex", "stored_last_seen"]


# A JSON state (the conversation's, a trace's before version 5) has last_seen as its last key;
# inside a string the quotes would be escaped, so the last match is the key. A binary one has it
# in its header. Eviction reads it without decoding the whole state.
_LAST_SEEN = b'"last_seen":'


def stored_last_seen(data: bytes) -> float:
    """The last_seen of a stored state; one that cannot be read counts as long idle."""
    binary = stored_state_last_seen(data)
    if binary is not None:
        return binary
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
