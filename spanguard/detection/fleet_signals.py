"""The signals of a fleet incident whose action is `contain`: every client refuses the tool.

An incident of action `contain` (spanguard/detection/fleet.py) sends a tool-scoped kill (the
contain, `schemas.decision.tool_signal`); its `recovered` record sends the release. The contain
expires after one fleet window: while it holds, the clients do not call the tool, so no trace
can show it answering again; on expiry the calls resume, and a tool still failing opens a new
incident (a new window step, a new dedup key) and is contained again. Pure: the worker's outbox
signs and sends what this returns.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

from spanguard.schemas.decision import Decision, KillSignal, tool_signal
from spanguard.schemas.policy import FleetPolicy

__all__ = ["containment_signals"]

CONTAIN = "contain"
RECOVERED = "recovered"


def containment_signals(decision: Decision, policy: FleetPolicy) -> list[KillSignal]:
    """The contain of an incident of action contain, or the release of its recovery (when the
    policy in force contains: in `--mode observe` its action is flag, and nothing is sent);
    none for any other decision."""
    scope = decision.scope
    if scope is None or scope.kind != "tool" or not scope.tool:
        return []
    kind: Literal["kill", "release"]
    if decision.action == CONTAIN:
        kind = "kill"
    elif decision.action == RECOVERED and policy.action == CONTAIN:
        kind = "release"
    else:
        return []
    detected = datetime.fromisoformat(decision.detected_at)
    expires = detected + timedelta(seconds=policy.window)
    return [
        tool_signal(
            scope.tool,
            scope.server or "",
            decision.rule,
            decision.reason,
            decision.decision_id,
            expires.isoformat(timespec="milliseconds"),
            kind=kind,
            detected_at=decision.detected_at,
        )
    ]
