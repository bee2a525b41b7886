"""Open fleet incidents, read by every worker from every partition of the detections topic.

A fleet incident's records (scope "tool") are keyed by the incident's trace id, so they land on
one partition, held by one worker; the traces decided on its tool land on every partition. So
each worker reads every partition of the detections topic (no consumer group, no commits, as the
release reader does the kill topic, connectors/releases.py) and notes the incidents it finds in
the paging agent's OpenIncidents: whichever worker holds a trace folds its page.

Only tool-scoped records matter: a look at the raw bytes skips the others before any JSON is
parsed. A record that looks tool-scoped but holds no decision is counted and skipped.

On start the reader goes back `horizon` seconds (a day, not the fleet window): an incident stays
open until its `recovered` record, however many windows that takes, so a worker restarted during
a long outage must still see the opening record. A day bounds what a start reads (the day's
detections, most skipped by the byte look); an incident open longer than that is forgotten by
every worker alike (`OpenIncidents.prune`), and its traces page one by one again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from spanguard.alerting.incidents import OpenIncidents, is_incident
from spanguard.config.settings import WorkerSettings
from spanguard.connectors.every_partition import EveryPartitionReader
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.schemas.decision import Decision

__all__ = ["INCIDENT_HORIZON", "IncidentReader", "IncidentSkip"]

log = logging.getLogger("spanguard.alerting")

INCIDENT_HORIZON = 86_400.0  # seconds read back on start: the longest fleet window allowed
# Only a tool-scoped record has this (`"scope": "tool"`); a per-trace one names `tool_name`.
TOOL_SCOPED = b'"tool"'


class IncidentSkip(CountedOutcome):
    """Why a record of the detections topic that looked tool-scoped was skipped."""

    UNREADABLE = "unreadable"  # not JSON, or not a decision


class IncidentReader(EveryPartitionReader):
    """A daemon thread that notes every fleet incident's records in `incidents`."""

    def __init__(
        self,
        settings: WorkerSettings,
        incidents: OpenIncidents,
        *,
        horizon: float = INCIDENT_HORIZON,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            settings, settings.detections_topic, "incidents", log, horizon=horizon, clock=clock
        )
        self.incidents = incidents
        self.read = 0  # incident records read
        self.skipped = Tally()  # by IncidentSkip

    def prune(self) -> int:
        return self.incidents.prune(self.clock() - self.horizon)

    def accept(self, value: bytes | None, appended_at: float) -> bool:
        """Take one record of the detections topic; True when it was an incident's record."""
        if value is None or TOOL_SCOPED not in value:
            return False
        try:
            decision = Decision.from_json(value)
        except ValueError as exc:
            if not self.skipped[IncidentSkip.UNREADABLE]:
                log.warning("detections topic: record skipped by the incident reader (%s)", exc)
            self.skipped.add(IncidentSkip.UNREADABLE)
            return False
        if not is_incident(decision):
            return False
        self.incidents.record(decision, noted_at=appended_at)
        self.read += 1
        return True
