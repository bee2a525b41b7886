"""The fetch watch's judgement: which partitions stand still with records waiting."""

from __future__ import annotations

from faust.types import TP

from spanguard.streams.fetch_watch import StallTracker

SPANS = TP("spans", 0)
OTHER = TP("spans", 1)


def test_a_partition_with_records_waiting_and_no_progress_is_told_once_after_the_delay():
    tracker = StallTracker(stall_after=15)
    assert tracker.observe(0, {SPANS: 10}, {SPANS: 4}) == []
    assert tracker.observe(10, {SPANS: 12}, {SPANS: 4}) == []
    [stall] = tracker.observe(15, {SPANS: 12}, {SPANS: 4})
    assert (stall.tp, stall.position, stall.end, stall.seconds) == (SPANS, 4, 12, 15)
    assert str(stall) == "spans/0 at 4 of 12 for 15s"
    assert tracker.observe(20, {SPANS: 12}, {SPANS: 4}) == []  # told already


def test_a_partition_without_a_fetch_position_stands_still_too():
    tracker = StallTracker(stall_after=15)
    tracker.observe(0, {SPANS: 3}, {SPANS: None})
    [stall] = tracker.observe(16, {SPANS: 3}, {SPANS: None})
    assert stall.position is None


def test_progress_or_nothing_waiting_starts_the_standing_again():
    tracker = StallTracker(stall_after=15)
    tracker.observe(0, {SPANS: 10, OTHER: 5}, {SPANS: 4, OTHER: 5})
    # SPANS moved on; OTHER had nothing waiting until now.
    assert tracker.observe(10, {SPANS: 10, OTHER: 7}, {SPANS: 6, OTHER: 5}) == []
    assert tracker.observe(20, {SPANS: 10, OTHER: 7}, {SPANS: 6, OTHER: 5}) == []
    stalled = tracker.observe(25, {SPANS: 10, OTHER: 7}, {SPANS: 6, OTHER: 5})
    assert [stall.tp for stall in stalled] == [SPANS, OTHER]


def test_a_stall_that_moved_on_is_told_again_when_it_stands_still_again():
    tracker = StallTracker(stall_after=15)
    tracker.observe(0, {SPANS: 10}, {SPANS: 4})
    assert len(tracker.observe(15, {SPANS: 10}, {SPANS: 4})) == 1
    tracker.observe(20, {SPANS: 12}, {SPANS: 10})
    assert len(tracker.observe(35, {SPANS: 12}, {SPANS: 10})) == 1


def test_a_partition_no_longer_wanted_or_a_rebalance_forgets_its_standing():
    tracker = StallTracker(stall_after=15)
    tracker.observe(0, {SPANS: 10}, {SPANS: 4})
    tracker.observe(10, {}, {})  # paused meanwhile
    assert tracker.observe(20, {SPANS: 10}, {SPANS: 4}) == []
    tracker.forget()
    assert tracker.observe(40, {SPANS: 10}, {SPANS: 4}) == []
    assert len(tracker.observe(55, {SPANS: 10}, {SPANS: 4})) == 1


def test_an_unknown_end_offset_is_not_a_stall():
    tracker = StallTracker(stall_after=15)
    tracker.observe(0, {SPANS: None}, {SPANS: None})
    assert tracker.observe(30, {SPANS: None}, {SPANS: None}) == []
