"""Which detections page, and what became of each page: the Faust-free half of the pager agent.

The worker's paging agent reads `spanguard-detections` (its own output) in a stream of its
own, so a slow or failing PagerDuty delays pages and never kill signals. What was paged is
remembered per trace in a changelog-backed table, so neither a retry nor a restart opens a
second incident for one trace and rule (and PagerDuty's dedup_key is a second line).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from spanguard.alerting.pagerduty import Pager, PageResult, dedup_key, should_page

__all__ = ["PagingService"]

log = logging.getLogger("spanguard.alerting")


class PagingService:
    def __init__(self, pager: Pager | None) -> None:
        self.pager = pager
        self.outcomes: Counter[str] = Counter()  # accepted, rejected, failed, already_paged, ...
        self._warned_unconfigured = False

    def detection_to_page(
        self, value: bytes | None, paged_rules: set[str]
    ) -> dict[str, Any] | None:
        """The detection in `value` if it must be paged now, else None (and why is counted)."""
        try:
            detection = json.loads(value or b"")
        except ValueError:
            self.outcomes["unreadable"] += 1
            return None
        if not isinstance(detection, dict) or not should_page(detection):
            return None
        if detection.get("rule") in paged_rules:
            self.outcomes["already_paged"] += 1
            return None
        if self.pager is None:
            self.outcomes["not_configured"] += 1
            if not self._warned_unconfigured:
                self._warned_unconfigured = True
                log.warning(
                    "an autonomous agent's detection is not paged: set"
                    " SPANGUARD_PAGERDUTY_ROUTING_KEY (or SPANGUARD_PAGERDUTY_ROUTING_KEY_FILE)"
                )
            return None
        return detection

    def page(self, detection: Mapping[str, Any]) -> PageResult:
        """Blocking (retries with backoff): call it from an executor thread."""
        assert self.pager is not None
        result = self.pager.page(detection)
        self.outcomes[result.status] += 1
        log.info(
            "page",
            extra={
                "dedup_key": dedup_key(detection),
                "status": result.status,
                "attempts": result.attempts,
            },
        )
        return result


def paged_rules(stored: bytes | None) -> set[str]:
    return set(json.loads(stored)) if stored else set()


def with_rule(stored: bytes | None, rule: str) -> bytes:
    return json.dumps(sorted(paged_rules(stored) | {rule})).encode()
