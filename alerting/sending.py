"""What the PagerDuty and webhook senders share: attempts with capped backoff
(connectors/outbound.py's `deliver`), the error line of a delivery that failed, and the count
and log line their agents' services keep of every result."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, Protocol, TypeVar

from spanguard.connectors.outbound import Delivery, Final, deliver
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.retry import Backoff

if TYPE_CHECKING:
    from spanguard.alerting.pagerduty import PageResult
    from spanguard.alerting.webhook import NotifyResult

__all__ = ["Sender", "count_result"]


class RetrySettings(Protocol):
    @property
    def max_attempts(self) -> int: ...
    @property
    def timeout(self) -> float: ...
    @property
    def backoff_base(self) -> float: ...
    @property
    def backoff_cap(self) -> float: ...


SettingsT = TypeVar("SettingsT", bound=RetrySettings)


class Sender(Generic[SettingsT]):
    """Sends with retries; safe to share between threads. `sleep` (default time.sleep) and
    `jitter` (default random.random, in [0, 1)) are injectable so tests need not wait."""

    what: ClassVar[str]  # names the attempts in log lines: "page", "webhook"
    log: ClassVar[logging.Logger]

    def __init__(
        self,
        settings: SettingsT,
        *,
        sleep: Callable[[float], None] = time.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self._sleep = sleep
        self._backoff = Backoff(settings.backoff_base, settings.backoff_cap, jitter)
        self._open()

    def _open(self) -> None:
        """Build the HTTP client (once, from `self.settings`)."""
        raise NotImplementedError

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based): `Backoff.delay`
        from `backoff_base` up to `backoff_cap`."""
        return self._backoff.delay(attempt, retry_after)

    def _attempts(self, attempt: Callable[[], int], context: dict[str, Any]) -> Delivery[int]:
        return deliver(
            attempt,
            max_attempts=self.settings.max_attempts,
            backoff=self._backoff,
            timeout=self.settings.timeout,
            what=self.what,
            sleep=self._sleep,
            log=self.log,
            context=context,
        )

    def _failed(
        self, outcome: Delivery[int], context: dict[str, Any], **extra: Any
    ) -> Literal["rejected", "failed"]:
        """Log a delivery that failed; its status."""
        failure = outcome.failure
        assert failure is not None
        status: Literal["rejected", "failed"] = (
            failure.status if isinstance(failure, Final) else "failed"
        )
        self.log.error(
            "%s %s after %d attempt(s): %s",
            self.what,
            status,
            outcome.attempts,
            failure.error,
            extra={**context, "attempts": outcome.attempts, **extra},
        )
        return status


ResultT = TypeVar("ResultT", "PageResult", "NotifyResult")


def count_result(
    result: ResultT, outcomes: Tally, outcome: type[CountedOutcome], log: logging.Logger, what: str
) -> ResultT:
    """Count what became of a delivery under its status, and log it."""
    outcomes.add(outcome(result.status))
    log.info(
        what,
        extra={"dedup_key": result.dedup_key, "status": result.status, "attempts": result.attempts},
    )
    return result
