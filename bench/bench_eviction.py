"""Longest pause eviction causes with a million idle traces, the old full scan as the baseline.

The worker's eviction (DecodedStates.evict_idle, run after every batch) against the scan the
worker used to run on a timer (Guard.evict_idle over every state), on the same million traces in
the same process. Prints one JSON line: the longest per-batch eviction, the scan, and their ratio.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from spanguard.detection.guard import Guard
from spanguard.detection.trace_state import TraceState
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.faust_internals import event_context


class Event:  # what DecodedStates reads of a Faust event; weak-referenceable like one
    def __init__(self, partition: int) -> None:
        self.message = SimpleNamespace(partition=partition)


TRACES = 1_000_000
PARTITIONS = 8


def main() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table)
    events = [Event(p) for p in range(PARTITIONS)]
    states.begin_batch()
    for n in range(TRACES):
        with event_context(events[n % PARTITIONS]):
            states[f"{n:032x}"] = TraceState(last_seen=float(n))
    states.flush()

    longest = 0.0
    evicted = 0
    cutoff = TRACES / 2  # half the traces are idle
    for _ in range(200):  # 200 batches' worth of eviction
        start = time.perf_counter()
        evicted += states.evict_idle(events, cutoff, 256)
        longest = max(longest, time.perf_counter() - start)

    guard = Guard(states={k.decode(): TraceState.from_bytes(v) for k, v in table.items()},
                  clock=lambda: TRACES + 0.0)  # fmt: skip
    start = time.perf_counter()
    scanned = guard.evict_idle(TRACES / 2)
    scan = time.perf_counter() - start
    print(json.dumps({
        "traces": TRACES,
        "longest_batch_eviction_ms": round(longest * 1000, 3),
        "evicted_in_200_batches": evicted,
        "full_scan_ms": round(scan * 1000, 1),
        "full_scan_evicted": scanned,
        "batch_to_scan": round(longest / scan, 5),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
