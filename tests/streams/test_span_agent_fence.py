"""The span agent under its lease (streams/agents/guard_spans.py, streams/fence.py): a batch
fetched by a worker whose lease lapsed is neither decided nor acked, and the revocation that
fences the worker lets go of it; a stop or a failure mid-batch writes nothing of that batch.

The agent, its Worker and the Faust app are the real ones, built as the worker builds them but
not started: nothing here reaches a broker (a batch that did would hang on its sends).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from faust.events import Event
from faust.types.tuples import Message

from spanguard.config.settings import WorkerSettings
from spanguard.detection.pipeline import PipelineCount
from spanguard.schemas.policy import Policy
from spanguard.streams.agents.guard_spans import SpanAgent
from spanguard.streams.app import build_worker, faust_app
from spanguard.streams.fence import Lease
from tests.support.leases import SESSION, Clock


def span_agent(data_dir: Path, clock: Clock) -> SpanAgent:
    settings = WorkerSettings(data_dir=str(data_dir), signing_key="ab" * 32)
    app = faust_app(settings)
    worker = build_worker(app, settings, Policy(), None, None, None)
    agent = SpanAgent(worker, Lease(SESSION, clock=clock))
    agent.lease.rebalance_began()
    agent.lease.assigned(None)  # no coordinator: the clock alone says whether it holds
    return agent


def taken(agent: SpanAgent, offsets: range) -> list[Event]:
    """Events as the stream hands them over, each message awaited by Faust until acked."""
    app = agent.worker.app
    topic = agent.worker.settings.input_topic
    events = []
    for offset in offsets:
        message = Message(topic, 0, offset, time.time(), 0, None, b"k", b"not otlp", None)
        app.consumer._unacked_messages.add(message)
        events.append(Event(app, message.key, message.value, None, message))
    return events


def test_a_batch_under_a_lapsed_lease_waits_then_is_dropped_undecided_when_fenced(
    tmp_path: Path,
) -> None:
    clock = Clock()
    agent = span_agent(tmp_path, clock)
    events = taken(agent, range(3))
    waited: list[bool] = []

    async def wait_empty() -> None:  # Faust's wait for every taken message to be acked
        waited.append(True)

    async def frozen_then_revoked() -> None:
        clock.now += SESSION  # woken from a freeze past the session timeout
        batch = asyncio.ensure_future(agent.guard_batch(events))
        await asyncio.sleep(0.3)
        assert not batch.done(), "a batch under a lapsed lease went on"
        assert agent.write_back.held == events
        await agent.write_back.flush_before_waiting(
            wait_empty
        )()  # the revocation, as Faust calls it
        await asyncio.wait_for(batch, 2)

    asyncio.run(frozen_then_revoked())
    assert waited == [True]
    assert agent.lease.fenced == 1
    assert agent.worker.pipeline.count(PipelineCount.MESSAGES) == 0  # nothing decided
    assert agent.write_back.held == []
    unacked = agent.worker.app.consumer._unacked_messages
    assert not any(event.message in unacked for event in events)  # Faust waits on none
    assert all(event.message.refcount == 1 for event in events)  # and none was acked
    # No progress claimed past the batch's first offset for what was dropped.
    assert agent.reached == {events[0].message.tp: 0}


def test_the_fenced_messages_are_counted_once_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent = span_agent(tmp_path, Clock())
    events = taken(agent, range(4))
    agent.write_back.held.extend(events)
    agent.write_back.release(events)  # the revocation
    agent.write_back.release(events[:2])  # the batch that was waiting, released again
    dropped = [r for r in caplog.records if r.getMessage() == "fenced messages dropped"]
    assert [record.messages for record in dropped] == [4]
    assert agent.write_back.held == []


def test_a_revocation_under_a_lease_that_holds_drops_nothing(tmp_path: Path) -> None:
    clock = Clock()
    agent = span_agent(tmp_path, clock)
    events = taken(agent, range(2))
    agent.write_back.held.extend(events)

    async def wait_empty() -> None:
        pass

    agent.write_back.in_batch = (
        True  # a batch still running flushes as it ends: nothing to flush here
    )
    asyncio.run(agent.write_back.flush_before_waiting(wait_empty)())
    assert agent.lease.fenced == 0
    assert agent.write_back.held == events
    unacked = agent.worker.app.consumer._unacked_messages
    assert all(event.message in unacked for event in events)


@pytest.mark.parametrize("stop", [asyncio.CancelledError(), RuntimeError("broken batch")])
def test_a_batch_cut_short_writes_nothing_of_it(tmp_path: Path, stop: BaseException) -> None:
    agent = span_agent(tmp_path, Clock())
    agent.write_back.held.extend(taken(agent, range(2)))
    agent.write_back.in_batch = True
    crashed = agent.write_back.interrupted(stop)
    assert agent.write_back.held == [] and not agent.write_back.in_batch
    failed = isinstance(stop, RuntimeError)
    assert crashed is failed
    assert (agent.write_back.unackable is stop) is failed  # a failure blocks every later batch


def test_a_stop_between_batches_keeps_what_is_held_for_the_last_flush(tmp_path: Path) -> None:
    agent = span_agent(tmp_path, Clock())
    events = taken(agent, range(2))
    agent.write_back.held.extend(events)
    assert agent.write_back.interrupted(asyncio.CancelledError()) is False
    assert agent.write_back.held == events  # flushed by the stop path, the lease holding
