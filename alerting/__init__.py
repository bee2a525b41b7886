"""Paging the on-call: PagerDuty incidents for loops on autonomous agents."""

from spanguard.alerting.pagerduty import (
    Pager,
    PagerConfigError,
    PageResult,
    PagerSettings,
    build_event,
    dedup_key,
    should_page,
)

__all__ = [
    "PageResult",
    "Pager",
    "PagerConfigError",
    "PagerSettings",
    "build_event",
    "dedup_key",
    "should_page",
]
