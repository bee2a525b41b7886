"""A flush written in steps (streams/write_back.py, `WriteBack.flush(in_steps=True)`): the
span agent encodes and stores a step's worth of states after each batch, so a kill arriving
during a flush waits for one step. Its messages are acked only once its last state is written
and the changelog acked it; a state changed again before its step is written as it is then; a
fence drops what is left unwritten and acks nothing.

The span agent, its Worker and the Faust app are the real ones, built as the worker builds them
but not started (tests/streams/test_deferred_records.py); the table is Faust's over its memory
store, whose changelog records are futures the test resolves, as the broker's acks would.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from faust.events import Event

from spanguard.detection.trace_state import TraceState
from spanguard.streams import write_back
from spanguard.streams.agents.guard_spans import SpanAgent
from spanguard.streams.faust_internals import event_context
from tests.streams.test_deferred_records import span_agent, taken
from tests.support.leases import SESSION, Clock, wait_empty

TRACES = 100


def trace(index: int) -> str:
    return f"{index:032x}"


def batch_writing(agent: SpanAgent, event: Event, traces: range, last_seen: float) -> None:
    """One batch of `event`, changing `traces` as the guard does (read, change, write)."""
    agent.write_back.hold([event])
    states = agent.worker.states
    states.begin_batch()
    with event_context(event):
        for index in traces:
            state = states.get(trace(index)) or TraceState()
            state.last_seen = last_seen
            states[trace(index)] = state


def ack_changelog(agent: SpanAgent) -> int:
    """The broker acks every changelog record sent so far; how many it had not acked."""
    acked = 0
    for future in SENT:
        if not future.done():
            future.set_result(None)
            acked += 1
    return acked


def stored(agent: SpanAgent, index: int) -> TraceState:
    return TraceState.from_bytes(agent.worker.table.data[trace(index).encode()])


# Every changelog record's delivery future, for the test to ack (`ack_changelog`).
SENT: list[asyncio.Future] = []


@pytest.fixture(autouse=True)
def smallest_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # A step stops at the first look at the clock (`WRITES_PER_CLOCK_READ` states), however
    # fast the machine.
    monkeypatch.setattr(write_back, "FLUSH_STEP_SECONDS", 0.0)
    SENT.clear()


def span_agent_recording(data_dir: Path, clock: Clock) -> SpanAgent:
    """The span agent, each changelog record it sends kept in SENT (sent as before)."""
    agent = span_agent(data_dir, clock)
    table = agent.worker.table
    send = table.send_changelog

    def sending(*args: object, **kwargs: object) -> asyncio.Future:
        future = send(*args, **kwargs)
        SENT.append(future)
        return future

    table.send_changelog = sending  # type: ignore[method-assign]
    return agent


def test_a_flush_in_steps_acks_its_messages_once_its_last_state_is_written_and_acked(
    tmp_path: Path,
) -> None:
    agent = span_agent_recording(tmp_path, Clock())
    first, second = taken(agent, agent.worker.settings.input_topic, [b"m0", b"m1"])
    states = agent.worker.states

    async def two_batches() -> None:
        batch_writing(agent, first, range(TRACES), last_seen=1.0)
        await agent.write_back.flush(acks_in_background=True, in_steps=True)
        assert agent.write_back.flushing is not None, "every state written in one step"
        assert 0 < len(agent.worker.table.data) < TRACES
        left = states.unflushed
        # The next batch reads a state not yet written (the flush writes the newest first):
        # the flush's own object, changed again.
        assert trace(0).encode() not in agent.worker.table.data
        batch_writing(agent, second, range(1), last_seen=2.0)
        assert states.unflushed == left  # the one changed again is counted once
        steps = 0
        while agent.write_back.flushing is not None:
            assert not first.message.acked
            ack_changelog(agent)
            await agent.write_back.write_step()
            steps += 1
        assert steps >= 2
        assert ack_changelog(agent) > 0 and agent.write_back.acking
        await asyncio.wait_for(asyncio.gather(*agent.write_back.acking), 2)

    asyncio.run(two_batches())
    assert first.message.acked and not second.message.acked  # the second waits for its flush
    assert agent.write_back.held == [second]
    assert len(agent.worker.table.data) == TRACES
    assert stored(agent, TRACES - 1).last_seen == 1.0
    assert stored(agent, 0).last_seen == 2.0  # written as it was at its step


def test_a_flush_due_while_another_is_in_steps_writes_the_rest_first(tmp_path: Path) -> None:
    agent = span_agent_recording(tmp_path, Clock())
    first, second = taken(agent, agent.worker.settings.input_topic, [b"m0", b"m1"])

    async def flush_over_a_flush() -> None:
        batch_writing(agent, first, range(TRACES), last_seen=1.0)
        await agent.write_back.flush(acks_in_background=True, in_steps=True)
        batch_writing(agent, second, range(TRACES, TRACES + 10), last_seen=2.0)
        await agent.write_back.flush(acks_in_background=True)
        assert agent.write_back.flushing is None
        ack_changelog(agent)
        await asyncio.wait_for(asyncio.gather(*agent.write_back.acking), 2)

    asyncio.run(flush_over_a_flush())
    assert first.message.acked and second.message.acked
    assert len(agent.worker.table.data) == TRACES + 10


def test_the_idle_timer_writes_the_steps_between_batches_only(tmp_path: Path) -> None:
    agent = span_agent_recording(tmp_path, Clock())
    (first,) = taken(agent, agent.worker.settings.input_topic, [b"m0"])

    async def idle_then_busy() -> None:
        batch_writing(agent, first, range(TRACES), last_seen=1.0)
        await agent.write_back.flush(acks_in_background=True, in_steps=True)
        written = len(agent.worker.table.data)
        agent.write_back.in_batch = True  # a batch runs: its decisions may await their acks
        await agent.write_back.flush_when_idle()
        assert len(agent.worker.table.data) == written
        agent.write_back.in_batch = False
        await agent.write_back.flush_when_idle()
        assert agent.write_back.flushing is None
        ack_changelog(agent)
        await asyncio.wait_for(asyncio.gather(*agent.write_back.acking), 2)

    asyncio.run(idle_then_busy())
    assert first.message.acked and len(agent.worker.table.data) == TRACES


def test_a_fence_during_a_flush_in_steps_writes_nothing_more_and_acks_nothing(
    tmp_path: Path,
) -> None:
    clock = Clock()
    agent = span_agent_recording(tmp_path, clock)
    (first,) = taken(agent, agent.worker.settings.input_topic, [b"m0"])

    async def fenced_between_steps() -> None:
        batch_writing(agent, first, range(TRACES), last_seen=1.0)
        await agent.write_back.flush(acks_in_background=True, in_steps=True)
        written = len(agent.worker.table.data)
        clock.now += SESSION  # the lease lapsed: the partitions may be another's already
        await agent.write_back.flush_before_waiting(wait_empty)()
        assert agent.write_back.flushing is None and agent.worker.states.unflushed == 0
        await agent.write_back.write_step()
        assert len(agent.worker.table.data) == written
        ack_changelog(agent)
        await asyncio.sleep(0.2)

    asyncio.run(fenced_between_steps())
    assert not first.message.acked
    assert agent.write_back.written == []  # released to the next owner, never acked here


def test_two_steps_under_way_at_once_ack_the_flush_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = span_agent_recording(tmp_path, Clock())
    (first,) = taken(agent, agent.worker.settings.input_topic, [b"m0"])
    table = agent.worker.table
    send_pending = table.send_pending

    async def slow_send_pending() -> None:
        await asyncio.sleep(0.05)  # a producer under backpressure: the send yields
        await send_pending()

    async def steps_at_once() -> None:
        batch_writing(agent, first, range(TRACES), last_seen=1.0)
        await agent.write_back.flush(acks_in_background=True, in_steps=True)
        monkeypatch.setattr(write_back, "FLUSH_STEP_SECONDS", 10.0)  # the next writes the rest
        monkeypatch.setattr(table, "send_pending", slow_send_pending)
        # The timer's step and a batch's end step, the second begun while the first sends.
        await asyncio.gather(agent.write_back.write_step(), agent.write_back.write_step())
        await asyncio.sleep(0.1)
        # The second step found nothing left to write: it must not ack the flush's messages
        # ahead of the changelog's acks of the first step's writes.
        assert not first.message.acked
        assert len(agent.write_back.acking) == 1
        ack_changelog(agent)
        await asyncio.wait_for(asyncio.gather(*agent.write_back.acking), 2)

    asyncio.run(steps_at_once())
    assert first.message.acked and len(agent.worker.table.data) == TRACES


def test_a_step_taken_while_a_flush_still_begins_leaves_the_writing_to_that_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timer's flush begins by sending the steps of the flush before it (or its scope
    records) and awaits the producer; a batch ending meanwhile takes a step. That step must not
    write and ack the flush whose records are not all known yet, nor leave it to fail when it
    resumes (the agent crashed there: "messages left unacked by an earlier failure")."""
    agent = span_agent_recording(tmp_path, Clock())
    first, second = taken(agent, agent.worker.settings.input_topic, [b"m0", b"m1"])
    table = agent.worker.table
    send_pending = table.send_pending

    async def slow_send_pending() -> None:
        await asyncio.sleep(0.05)  # a producer under backpressure: the send yields
        await send_pending()

    async def step_while_a_flush_begins() -> None:
        batch_writing(agent, first, range(TRACES), last_seen=1.0)
        await agent.write_back.flush(acks_in_background=True, in_steps=True)
        batch_writing(agent, second, range(TRACES, TRACES + 10), last_seen=2.0)
        monkeypatch.setattr(write_back, "FLUSH_STEP_SECONDS", 10.0)  # a step writes the rest
        monkeypatch.setattr(table, "send_pending", slow_send_pending)
        await asyncio.gather(
            agent.write_back.flush(acks_in_background=True, in_steps=True),
            agent.write_back.write_step(),
        )
        assert agent.write_back.flushing is None and agent.write_back.unackable is None
        assert not first.message.acked and not second.message.acked  # the changelog acks first
        ack_changelog(agent)
        await asyncio.wait_for(asyncio.gather(*agent.write_back.acking), 2)

    asyncio.run(step_while_a_flush_begins())
    assert first.message.acked and second.message.acked
    assert len(agent.worker.table.data) == TRACES + 10
