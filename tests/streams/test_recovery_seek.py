"""What a flow control resume drops from the queues, and where the seek back goes."""

from __future__ import annotations

from types import SimpleNamespace

from faust.types import TP
from mode.utils.queues import FlowControlEvent, FlowControlQueue

from spanguard.streams.recovery_seek import dropped_offsets

SPANS_0, SPANS_1 = TP("spans", 0), TP("spans", 1)


def event(tp: TP, offset: int, generation: int) -> SimpleNamespace:
    message = SimpleNamespace(tp=tp, offset=offset, generation_id=generation)
    return SimpleNamespace(message=message)


def test_the_lowest_dropped_offset_per_partition_of_the_current_generation_only():
    flow = FlowControlEvent(initially_suspended=False)
    agent_queue = FlowControlQueue(flow_control=flow, clear_on_resume=True)
    other_queue = FlowControlQueue(flow_control=flow, clear_on_resume=True)
    for item in (event(SPANS_0, 12, 3), event(SPANS_0, 10, 3), event(SPANS_1, 7, 2)):
        agent_queue.put_nowait(item)
    other_queue.put_nowait(event(SPANS_1, 9, 3))
    other_queue.put_nowait("not an event")

    lowest, count = dropped_offsets(flow._queues, generation=3)

    assert lowest == {SPANS_0: 10, SPANS_1: 9}  # the generation-2 record is the streams' to skip
    assert count == 3
    flow.resume()  # what the resume then drops
    assert agent_queue.empty() and other_queue.empty()


def test_nothing_queued_drops_nothing():
    flow = FlowControlEvent(initially_suspended=False)
    FlowControlQueue(flow_control=flow, clear_on_resume=True)
    assert dropped_offsets(flow._queues, generation=1) == ({}, 0)
