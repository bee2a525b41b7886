"""The shared retry policy (spanguard/retry.py) that the judge and the pager both follow."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from spanguard.retry import Backoff, is_retryable_status, retry_after_seconds


@pytest.mark.parametrize(
    ("status", "retryable"),
    [(408, True), (429, True), (500, True), (503, True), (599, True), (400, False),
     (401, False), (403, False), (404, False), (409, False), (422, False), (302, False)],
)  # fmt: skip
def test_which_statuses_are_retried(status, retryable):
    assert is_retryable_status(status) is retryable


NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("7", 7.0),
        (" 0 ", 0.0),
        ("1.5", 1.5),
        ("Sun, 01 Mar 2026 12:00:30 GMT", 30.0),  # an HTTP date, 30 s from now
        ("Sun, 01 Mar 2026 11:00:00 GMT", 0.0),  # in the past: go now
        (None, None),
        ("", None),
        ("-3", None),
        ("nan", None),
        ("inf", None),
        ("soon", None),
    ],
)
def test_retry_after_seconds(value, seconds):
    assert retry_after_seconds(value, now=NOW) == seconds


def test_backoff_is_capped_exponential_with_jitter_in_half_to_full():
    top = Backoff(1.0, 4.0, jitter=lambda: 0.999999)
    bottom = Backoff(1.0, 4.0, jitter=lambda: 0.0)
    assert [round(top.delay(n), 3) for n in range(1, 7)] == [1, 2, 4, 4, 4, 4]
    assert [bottom.delay(n) for n in range(1, 7)] == [0.5, 1, 2, 2, 2, 2]
    assert top.delay(10_000) == pytest.approx(4.0)  # no overflow on a huge attempt number


def test_retry_after_replaces_the_backoff_and_is_capped():
    backoff = Backoff(30.0, 60.0, jitter=lambda: 0.5)
    assert backoff.delay(1, retry_after=0.0) == 0.0  # the server says now: not 30 s
    assert backoff.delay(1, retry_after=7.0) == 7.0
    assert backoff.delay(1, retry_after=900.0) == 60.0


@pytest.mark.parametrize(("base", "cap"), [(-1.0, 1.0), (1.0, -1.0), (float("nan"), 1.0)])
def test_backoff_refuses_unusable_bounds(base, cap):
    with pytest.raises(ValueError, match="backoff"):
        Backoff(base, cap)
