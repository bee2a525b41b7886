"""Faust's flow control resume, wrapped: records of the current generation stay queued."""

from __future__ import annotations

from types import SimpleNamespace

from faust.types import TP
from mode.utils.queues import FlowControlEvent, FlowControlQueue

from spanguard.streams.flow_resume import KeepCurrentOnResume, ResumeCount

SPANS_0, SPANS_1 = TP("spans", 0), TP("spans", 1)


def event(tp: TP, offset: int, generation: int) -> SimpleNamespace:
    message = SimpleNamespace(
        tp=tp, topic=tp.topic, partition=tp.partition, offset=offset, generation_id=generation
    )
    return SimpleNamespace(message=message)


def app_at(generation: int) -> SimpleNamespace:
    return SimpleNamespace(
        flow_control=FlowControlEvent(initially_suspended=True), consumer_generation_id=generation
    )


def test_a_resume_drops_the_earlier_generations_and_keeps_this_ones_in_order():
    app = app_at(3)
    keeper = KeepCurrentOnResume(app)
    keeper.attach()
    agent_queue = FlowControlQueue(flow_control=app.flow_control, clear_on_resume=True)
    other_queue = FlowControlQueue(flow_control=app.flow_control, clear_on_resume=True)
    stale, first, second = event(SPANS_0, 5, 2), event(SPANS_0, 9, 3), event(SPANS_0, 10, 3)
    for item in (stale, first, second):
        agent_queue.put_nowait(item)
    other_queue.put_nowait(event(SPANS_1, 4, 2))

    app.flow_control.resume()

    assert app.flow_control.is_active()
    assert [agent_queue.get_nowait(), agent_queue.get_nowait()] == [first, second]
    assert agent_queue.empty() and other_queue.empty()
    assert keeper.outcomes.count(ResumeCount.RECORDS_KEPT) == 2


def test_the_revocations_clear_still_drops_everything():
    app = app_at(3)
    KeepCurrentOnResume(app).attach()
    queue = FlowControlQueue(flow_control=app.flow_control, clear_on_resume=True)
    queue.put_nowait(event(SPANS_0, 9, 3))
    app.flow_control.suspend()
    app.flow_control.clear()  # what Faust's revocation does
    assert queue.empty()


def test_without_the_wrapper_faust_drops_this_generations_records_too():
    """What the wrapper is for: the resume at the end of a recovery empties the queues."""
    app = app_at(3)
    queue = FlowControlQueue(flow_control=app.flow_control, clear_on_resume=True)
    queue.put_nowait(event(SPANS_0, 9, 3))
    app.flow_control.resume()
    assert queue.empty()
