"""Paging the on-call: PagerDuty incidents for loops on autonomous agents."""

# Installed as spanguard.alerting; loaded by its folder name (from the repository root) each of its
# modules would exist twice, with two copies of every class.
if __name__ != "spanguard.alerting":
    raise ImportError(f"import spanguard.alerting, not {__name__}")

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
