"""When to try again and how long to wait: the one retry policy of the judge and the pager.

Pure (no HTTP, no clock, no sleeping): the callers run their own loop, sync (the pager, in an
executor thread) or async (the judge), and ask this module three things:

- `is_retryable_status(status)`: 408, 429 and 5xx are worth another attempt; any other 4xx
  (a bad key, a bad model name, an invalid event) fails the same way every time.
- `retry_after_seconds(value)`: a `Retry-After` header, in seconds or as an HTTP date.
- `Backoff.delay(attempt, retry_after)`: capped exponential growth from `base` with jitter in
  [50%, 100%] of it (so that callers failing together do not retry together), or the server's
  `Retry-After` when it gave one, capped too (a server asking for an hour does not stall a page
  or a verdict for an hour).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

__all__ = ["Backoff", "is_retryable_status", "retry_after_seconds"]


def is_retryable_status(status: int) -> bool:
    """408 (request timeout), 429 (rate limited) and 5xx are transient; other 4xx are final."""
    return status in (408, 429) or status >= 500


def retry_after_seconds(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header value: a number of seconds or an HTTP date
    (measured from `now`, default the current time); None when absent or unreadable."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # an HTTP date is GMT; a zoneless one is read as such
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
        return max(0.0, seconds)
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


@dataclass(frozen=True, slots=True)
class Backoff:
    """Capped, jittered exponential backoff. `jitter` returns a number in [0, 1) (injectable so
    tests can pin it)."""

    base: float = 0.5
    cap: float = 30.0
    jitter: Callable[[], float] = field(default=random.random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base) and math.isfinite(self.cap)):
            raise ValueError("backoff base and cap must be finite")
        if self.base < 0 or self.cap < 0:
            raise ValueError("backoff base and cap must not be negative")

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based): the server's
        Retry-After when given (it knows when it will take requests again), else
        min(cap, base * 2**(attempt-1)) scaled by a jitter in [0.5, 1]; never above `cap`."""
        if retry_after is not None:
            return min(max(0.0, retry_after), self.cap)
        # The exponent is bounded so a large attempt number cannot overflow the float.
        ceiling = min(self.cap, self.base * 2.0 ** min(attempt - 1, 64))
        return ceiling * (0.5 + 0.5 * self.jitter())
