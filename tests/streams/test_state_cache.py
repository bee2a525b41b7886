"""Decoded states kept between batches: what the cache serves is what the table holds.

Faust events and messages are the real types; the table is a dict, which DecodedStates
takes like a Faust table (the Kafka tests run the worker, cache on, over the RocksDB store).
"""

from __future__ import annotations

import faust
import pytest
from faust.types import Message

from spanguard.detection.guard import Guard
from spanguard.detection.rules.base import Fired
from spanguard.detection.trace_state import TraceState
from spanguard.streams import decoded_states
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.faust_internals import event_context
from tests.support.spans import AgentRecorder, encode

APP = faust.App("state-cache-test")
TRACE = "a" * 32


def event(partition: int, offset: int = 0) -> faust.Event:
    message = Message("otlp_spans", partition, offset, 0.0, 0, None, b"k", b"v", None)
    return faust.Event(APP, b"k", b"v", None, message)


def touch(states: DecodedStates, trace_id: str, partition: int, last_seen: float) -> TraceState:
    """One batch reading, changing and writing one trace, as the guard does."""
    states.begin_batch()
    with event_context(event(partition)):
        state = states.get(trace_id) or TraceState()
        state.last_seen = last_seen
        states[trace_id] = state
    states.flush()
    return state


def read(states: DecodedStates, trace_id: str, partition: int) -> TraceState | None:
    with event_context(event(partition)):
        return states.get(trace_id)


def test_a_batchs_writes_reach_the_table_and_the_next_read_skips_the_decode() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, cache_size=10)
    written = touch(states, TRACE, 0, last_seen=5.0)
    assert table[TRACE.encode()] == written.to_bytes()
    assert states.cached == 1
    assert read(states, TRACE, 0) is written  # the object itself, not a decode of the bytes


def test_without_a_cache_every_read_decodes_the_table() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, cache_size=0)
    written = touch(states, TRACE, 0, last_seen=5.0)
    assert states.cached == 0
    again = read(states, TRACE, 0)
    assert again is not written and again == written


def test_a_revoked_partitions_cached_states_are_dropped() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, cache_size=10)
    touch(states, TRACE, 1, last_seen=5.0)
    touch(states, "b" * 32, 2, last_seen=5.0)
    states.revoke({1})
    # Another worker moved the trace on while partition 1 was away; it comes back recovered.
    table[TRACE.encode()] = TraceState(service="elsewhere", last_seen=50.0).to_bytes()
    states.assigned(1, iter(list(table.items())))
    back = read(states, TRACE, 1)
    assert back is not None and back.service == "elsewhere" and back.last_seen == 50.0
    assert states.cached == 1  # partition 2, still owned, keeps its state
    assert read(states, "b" * 32, 2) is not None


def test_a_fenced_worker_forgets_every_partition_even_those_it_gets_back() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, cache_size=10)
    touch(states, TRACE, 1, last_seen=5.0)
    states.assigned(1, iter([]))
    # Fenced out of the group: the next generation gives partition 1 back without Faust
    # calling it revoked, after the worker that held it meanwhile killed the trace.
    states.revoke_all()
    assert states.cached == 0 and states.indexed() == 0
    killed = TraceState(service="elsewhere", last_seen=50.0)
    killed.fired.add(Fired("tool_loop", "kill"))
    table[TRACE.encode()] = killed.to_bytes()
    states.assigned(1, iter(list(table.items())))  # indexed again from what was recovered
    back = read(states, TRACE, 1)
    assert back is not None and back.fired == {Fired("tool_loop", "kill")}
    assert back.last_seen == 50.0


def test_states_discarded_before_their_flush_change_nothing_cached() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, cache_size=10)
    touch(states, TRACE, 0, last_seen=5.0)
    states.begin_batch()
    with event_context(event(0)):
        state = states.get(TRACE)
        assert state is not None
        state.fired.add(Fired("tool_loop", "kill"))  # changed in place, as the guard does
        states[TRACE] = state
    # ...and the batch dies before flush(): its messages are not acked, nothing was written.
    states.drop_unflushed()
    states.begin_batch()
    again = read(states, TRACE, 0)
    assert again is not None and again.fired == set() and again.last_seen == 5.0
    states.flush()


def test_an_evicted_traces_cached_state_goes_with_it() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, bucket_seconds=1.0, cache_size=10)
    touch(states, TRACE, 0, last_seen=10.0)
    assert states.evict_idle([event(0)], cutoff=50.0, limit=256) == 1
    assert table == {} and states.cached == 0
    assert read(states, TRACE, 0) is None


def test_the_cache_keeps_the_most_recently_used_states() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, cache_size=2)
    first = touch(states, "1" * 32, 0, last_seen=1.0)
    touch(states, "2" * 32, 0, last_seen=2.0)
    touch(states, "3" * 32, 0, last_seen=3.0)
    assert states.cached == 2
    # The oldest fell out of the cache, not out of the table.
    again = read(states, "1" * 32, 0)
    assert again is not first and again == first


def test_one_trace_id_on_two_partitions_keeps_two_states_as_the_store_does() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, cache_size=10)
    touch(states, TRACE, 0, last_seen=1.0)
    touch(states, TRACE, 1, last_seen=2.0)
    zero, one = read(states, TRACE, 0), read(states, TRACE, 1)
    assert zero is not None and one is not None
    assert (zero.last_seen, one.last_seen) == (1.0, 2.0)


def test_a_retraction_outside_any_event_is_written_with_its_batch() -> None:
    """The worker retracts a kill whose signal could not be sent after the batch's messages
    were handled, outside any message's context: the retracted state is what gets written,
    to the partition of the message that tripped it, and what the next message reads."""
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, cache_size=10)
    guard = Guard(states=states)
    agent = AgentRecorder()
    for _ in range(4):
        agent.tool("search_docs", {"query": "refund policy"})
    states.begin_batch()
    with event_context(event(3)):
        (decision,) = guard.process(encode(agent.finished()))
    guard.retract(decision)  # no current event here
    states.flush()
    (key,) = table
    assert TraceState.from_bytes(table[key]).fired == set()
    state = read(states, key.decode(), 3)
    assert state is not None and state.fired == set()


def test_a_trace_touched_by_many_batches_between_flushes_is_written_once() -> None:
    """The record cache: batches go on reading the unflushed state, and one flush writes each
    trace once, in the context of the last event that touched it (its partition)."""

    class CountingTable(dict[bytes, bytes]):
        writes: list[tuple[bytes, int]] = []

        def __setitem__(self, key: bytes, value: bytes) -> None:
            from faust.streams import current_event

            self.writes.append((key, current_event().message.offset))
            super().__setitem__(key, value)

    table = CountingTable()
    states = DecodedStates(table, cache_size=10)
    for offset in range(5):
        states.begin_batch()  # one window across the batches: nothing written yet
        with event_context(event(3, offset)):
            state = states.get(TRACE) or TraceState()
            state.last_seen = float(offset)
            state.fired.add(Fired("seen", str(offset)))
            states[TRACE] = state
        assert table == {} and states.unflushed == 1
    states.flush()
    assert table.writes == [(TRACE.encode(), 4)]  # once, in the last event's context
    stored = TraceState.from_bytes(table[TRACE.encode()])
    assert stored.last_seen == 4.0 and stored.fired == {Fired("seen", str(n)) for n in range(5)}
    assert states.unflushed == 0
    assert read(states, TRACE, 3) == stored


@pytest.mark.parametrize("taken", [False, True], ids=["unflushed", "taken by a flush"])
def test_a_trace_not_yet_written_is_not_evicted_on_its_stale_stored_state(taken: bool) -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, bucket_seconds=1.0, cache_size=10)
    touch(states, TRACE, 0, last_seen=10.0)
    states.begin_batch()
    with event_context(event(0, 1)):
        state = states.get(TRACE)
        assert state is not None
        state.last_seen = 100.0  # touched again, not flushed yet
        states[TRACE] = state
    if taken:
        states.start_flush()  # taken, not yet written: the store still says idle
    # The stale index entry (bucket 10) is examined; the stored state says idle, the open one
    # does not.
    assert states.evict_idle([event(0, 1)], cutoff=50.0, limit=256) == 0
    states.flush()
    assert TraceState.from_bytes(table[TRACE.encode()]).last_seen == 100.0


def test_a_revoked_partitions_unflushed_states_are_not_written() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, cache_size=10)
    states.begin_batch()
    for partition, trace_id in ((1, TRACE), (2, "b" * 32)):
        with event_context(event(partition)):
            states[trace_id] = TraceState(last_seen=1.0)
    states.revoke({1})  # its next owner decides those messages again
    states.flush()
    assert list(table) == [b"b" * 32]


def test_a_stored_state_that_is_no_state_starts_its_trace_afresh(caplog) -> None:
    """Truncated or garbage bytes in the table cost that trace's memory, never the batch."""
    good = TraceState(service="svc", last_seen=5.0).to_bytes()
    for stored in (good[: len(good) // 2], b"\x00\x05garbage", b'{"v": 4'):
        table = {TRACE.encode(): stored}
        states = DecodedStates(table, cache_size=10)
        with caplog.at_level("WARNING"):
            assert read(states, TRACE, 0) is None
        assert states.unreadable == 1
        assert "started afresh" in caplog.records[-1].getMessage()
        assert touch(states, TRACE, 0, last_seen=6.0).service == "unknown_service"
        assert TraceState.from_bytes(table[TRACE.encode()]).last_seen == 6.0


# -- a flush written in steps (`start_flush`, `write_some`) ----------------------------------


def taken_for_writing(states: DecodedStates, partitions: dict[str, int]) -> None:
    """One batch changing each trace on its partition, then taken by a flush, none written."""
    states.begin_batch()
    for trace_id, partition in partitions.items():
        with event_context(event(partition)):
            states[trace_id] = TraceState(last_seen=1.0)
    states.start_flush()


def test_states_taken_by_a_flush_are_read_from_it_until_written() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, cache_size=10)
    taken_for_writing(states, {TRACE: 0})
    assert table == {} and states.unflushed == 1
    state = read(states, TRACE, 0)
    assert state is not None and state.last_seen == 1.0  # not a miss, not the store's
    assert states.write_some(None) is True
    assert TraceState.from_bytes(table[TRACE.encode()]).last_seen == 1.0
    assert states.unflushed == 0


def test_a_step_writes_some_and_the_rest_waits_for_the_next() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, cache_size=100)
    traces = {f"{index:032x}": 0 for index in range(40)}
    taken_for_writing(states, traces)
    assert states.write_some(0.0) is False  # one look at the clock
    step = decoded_states.WRITES_PER_CLOCK_READ
    assert len(table) == step and states.unflushed == len(traces) - step
    while not states.write_some(0.0):
        pass
    assert sorted(table) == sorted(trace_id.encode() for trace_id in traces)


def test_states_left_unwritten_by_a_flush_go_with_a_revocation_a_drop_or_a_delete() -> None:
    table: dict[bytes, bytes] = {}
    states = DecodedStates(table, cache_size=10)
    other = "b" * 32
    taken_for_writing(states, {TRACE: 1, other: 2})
    states.revoke({1})  # its next owner decides those messages again
    assert states.unflushed == 1
    with pytest.raises(KeyError):  # never stored: the table's own KeyError, after the drop
        del states[other]
    assert states.unflushed == 0

    taken_for_writing(states, {TRACE: 1, other: 2})
    states.drop_unflushed()  # a batch failed: nothing since the last flush is written
    assert states.unflushed == 0
    states.write_some(None)
    assert table == {}
