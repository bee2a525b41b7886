"""Which detections page, and what became of each page: the Faust-free half of the pager agent.

The worker's paging agent reads `spanguard-detections` (its own output) in a stream of its
own, so a slow or failing PagerDuty delays pages and never kill signals. What was paged is
remembered per trace in a changelog-backed table, so neither a retry nor a restart opens a
second incident for one trace and rule (and PagerDuty's dedup_key is a second line).
"""

from __future__ import annotations

import json
import logging

from spanguard.alerting.incidents import OpenIncidents, delivery_mark, is_incident
from spanguard.alerting.pagerduty import Pager, PageResult, should_page
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.schemas.decision import Decision

__all__ = ["PageOutcome", "PagingService"]

log = logging.getLogger("spanguard.alerting")


class PageOutcome(CountedOutcome):
    """What became of a detection the paging agent read."""

    ACCEPTED = "accepted"  # PagerDuty took the page (PageResult's statuses, then ours)
    REJECTED = "rejected"
    FAILED = "failed"
    ALREADY_PAGED = "already_paged"  # this trace and rule paged before
    FOLDED = "folded"  # a trace decided on a tool with an open fleet incident: paged as one
    NOT_CONFIGURED = "not_configured"  # it would page, but no routing key is set
    UNREADABLE = "unreadable"  # not JSON


class PagingService:
    def __init__(self, pager: Pager | None, incidents: OpenIncidents | None = None) -> None:
        self.pager = pager
        # The worker's, which its incident reader fills from every partition (streams/app.py).
        self.incidents = OpenIncidents() if incidents is None else incidents
        self.outcomes = Tally()
        self._warned_unconfigured = False

    def detection_to_page(self, value: bytes | None, paged_rules: set[str]) -> Decision | None:
        """The detection in `value` if it must be paged now, else None (and why is counted)."""
        try:
            decision = Decision.from_json(value or b"")
        except ValueError:
            self.outcomes.add(PageOutcome.UNREADABLE)
            return None
        if not should_page(decision):
            return None
        if delivery_mark(decision) in paged_rules:
            self.outcomes.add(PageOutcome.ALREADY_PAGED)
            return None
        # One page per cause: an incident is noted open (or closed) before it pages, and a
        # trace decided on its tool meanwhile is folded into it. The incident reader notes the
        # incidents on the other partitions (alerting/incident_reader.py).
        if is_incident(decision):
            self.incidents.record(decision)
        elif self.incidents.fold(decision) is not None:
            self.outcomes.add(PageOutcome.FOLDED)
            return None
        if self.pager is None:
            self.outcomes.add(PageOutcome.NOT_CONFIGURED)
            if not self._warned_unconfigured:
                self._warned_unconfigured = True
                log.warning(
                    "an autonomous agent's detection is not paged: set"
                    " SPANGUARD_PAGERDUTY_ROUTING_KEY (or SPANGUARD_PAGERDUTY_ROUTING_KEY_FILE)"
                )
            return None
        return decision

    def page(self, decision: Decision) -> PageResult:
        """Blocking (retries with backoff): call it from an executor thread."""
        assert self.pager is not None
        result = self.pager.page(decision)
        self.outcomes.add(PageOutcome(result.status))
        log.info(
            "page",
            extra={
                "dedup_key": result.dedup_key,
                "status": result.status,
                "attempts": result.attempts,
            },
        )
        return result


def paged_rules(stored: bytes | None) -> set[str]:
    return set(json.loads(stored)) if stored else set()


def with_rule(stored: bytes | None, rule: str) -> bytes:
    return json.dumps(sorted(paged_rules(stored) | {rule})).encode()
