"""The expiry index stays right across rebalances: what it holds is a hint, the store decides.

Faust events and messages are the real types; the table is a dict, which DecodedStates
takes like a Faust table (the Kafka test in test_eviction_kafka.py runs the RocksDB store).
"""

from __future__ import annotations

import gc

import faust
from faust.types import Message

from spanguard.detection.trace_state import TraceState
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.expiry import stored_last_seen
from spanguard.streams.faust_internals import event_context

APP = faust.App("expiry-index-test")


def event(partition: int) -> faust.Event:
    message = Message("otlp_spans", partition, 0, 0.0, 0, None, b"k", b"v", None)
    return faust.Event(APP, b"k", b"v", None, message)


def write(states: DecodedStates, trace_id: str, partition: int, last_seen: float) -> None:
    """A batch that touches one trace, as the worker writes it."""
    states.begin_batch()
    with event_context(event(partition)):
        states[trace_id] = TraceState(last_seen=last_seen)
    states.flush()


def stored(last_seen: float) -> bytes:
    return TraceState(last_seen=last_seen).to_bytes()


def test_a_trace_touched_elsewhere_while_its_partition_was_away_is_kept() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, bucket_seconds=1.0)
    write(states, "a" * 32, 0, last_seen=10.0)
    # Partition 0 moves to another worker, which touches the trace; it comes back with the
    # newer state recovered from the changelog.
    states.revoke({0})
    table[b"a" * 32] = stored(100.0)
    states.assigned(0, iter(list(table.items())))
    assert states.evict_idle([event(0)], cutoff=50.0, limit=256) == 0
    assert b"a" * 32 in table
    assert states.evict_idle([event(0)], cutoff=150.0, limit=256) == 1
    assert table == {}


def test_the_stored_last_seen_wins_over_a_stale_index_entry() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, bucket_seconds=1.0)
    write(states, "b" * 32, 0, last_seen=10.0)
    table[b"b" * 32] = stored(100.0)  # changed without this worker's index knowing
    assert states.evict_idle([event(0)], cutoff=50.0, limit=256) == 0
    assert b"b" * 32 in table
    # Re-indexed by its own last_seen: evicted once that is old enough.
    assert states.evict_idle([event(0)], cutoff=150.0, limit=256) == 1


def test_an_index_entry_of_a_trace_already_gone_is_skipped() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, bucket_seconds=1.0)
    write(states, "c" * 32, 0, last_seen=10.0)
    del table[b"c" * 32]
    assert states.evict_idle([event(0)], cutoff=50.0, limit=256) == 0


def test_a_revoked_partitions_index_is_dropped() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, bucket_seconds=1.0)
    write(states, "d" * 32, 1, last_seen=10.0)
    states.revoke({1})
    # Not owned any more: even with a message of that partition, nothing is deleted.
    assert states.evict_idle([event(1)], cutoff=50.0, limit=256) == 0
    assert b"d" * 32 in table


def test_recovered_traces_are_indexed_a_few_per_batch_and_evicted() -> None:
    table = {f"{n:032x}".encode(): stored(float(n)) for n in range(2000)}
    states = DecodedStates(table, bucket_seconds=1.0)
    states.assigned(2, iter(list(table.items())))
    assert states.scanning == 1
    batches = []
    while True:
        evicted = states.evict_idle([event(2)], cutoff=1000.0, limit=64)
        batches.append(evicted)
        if not evicted and not states.scanning:
            break
    assert max(batches) <= 64  # bounded work per batch
    assert sorted(table) == [f"{n:032x}".encode() for n in range(1000, 2000)]


def test_a_recovered_trace_touched_again_is_evicted_by_its_new_touch() -> None:
    table = {b"e" * 32: stored(10.0)}
    states = DecodedStates(table, bucket_seconds=1.0)
    states.assigned(3, iter(list(table.items())))
    states.evict_idle([event(3)], cutoff=0.0, limit=256)  # scans it into the index
    write(states, "e" * 32, 3, last_seen=100.0)
    assert states.evict_idle([event(3)], cutoff=50.0, limit=256) == 0
    assert states.evict_idle([event(3)], cutoff=150.0, limit=256) == 1


def test_a_partition_kept_through_a_rebalance_is_not_rescanned() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, bucket_seconds=1.0)
    states.assigned(0, iter([]))
    states.evict_idle([event(0)], cutoff=0.0, limit=256)
    assert states.scanning == 0
    states.assigned(0, iter(list(table.items())))  # the next recovery, partition 0 stayed
    assert states.scanning == 0


def test_the_stored_last_seen_is_read_without_being_fooled_by_names() -> None:
    state = TraceState(service='svc "last_seen":99}', agent_name="last_seen", last_seen=1234.5)
    assert stored_last_seen(state.to_bytes()) == 1234.5
    assert stored_last_seen(b"not json") == 0.0  # unreadable: evicted as long idle


def test_the_index_is_nothing_the_garbage_collector_walks() -> None:
    # A million entries in GC-tracked containers add tens of milliseconds to every full
    # collection, on the loop that heartbeats; untracked dicts of strings add nothing.
    states = DecodedStates({}, bucket_seconds=1.0)
    for n in range(1000):
        write(states, f"{n:032x}", 0, last_seen=float(n))
    (index,) = states._expiry.values()
    assert not gc.is_tracked(index.bucket_of)
    assert not any(gc.is_tracked(members) for members in index.buckets.values())
