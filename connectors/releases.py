"""Operators' releases, read by every worker: `spanguard release` re-arms the loop rules.

A release is a signed signal on the kill topic (connectors/manual.py). The trace it names lives in
whichever partition its spans arrive on, which depends on the producer's partitioner, so no
one partition of the kill topic can be routed to the worker that holds the trace. Instead
every worker reads every partition of the kill topic (no consumer group, no commits, like an
agent's killswitch), keeps {trace id: when issued} for the releases of the last `horizon`
seconds, and its guard applies a release when the trace's next message arrives
(`Guard._apply_release`). Releases are operator actions: a handful, read at a few records a
second at most, so the map stays small; it is bounded all the same.

On start the reader goes back `horizon` seconds (the state TTL: an older release names a trace
whose state is evicted or already holds it), so a restarted worker still knows the releases
its traces have not seen yet. Only signals signed with the worker's key are read (unsigned too
under SPANGUARD_ALLOW_UNSIGNED); anything else on the topic is counted and skipped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from spanguard.config.settings import WorkerSettings
from spanguard.connectors.every_partition import EveryPartitionReader
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.schemas.decision import BadSignal, keyring, read_signal

__all__ = ["MAX_RELEASES", "ReleaseCount", "ReleaseReader", "ReleaseSkip"]

log = logging.getLogger("spanguard.worker")

# Releases kept at most: far more than operators issue within a state TTL.
MAX_RELEASES = 100_000


class ReleaseCount(CountedOutcome):
    """What the release reader counts: each member names a counter of ReleaseReader."""

    READ = "read"  # releases read


class ReleaseSkip(CountedOutcome):
    """Why a record of the kill topic was skipped: the kinds of BadSignal (read_signal)."""

    EMPTY = "empty"
    TOO_LARGE = "too_large"
    NOT_UTF8 = "not_utf8"
    TOO_DEEP = "too_deep"
    NOT_JSON = "not_json"
    NOT_OBJECT = "not_object"
    INVALID = "invalid"
    UNSIGNED = "unsigned"
    UNKNOWN_KEY = "unknown_key"
    FORGED = "forged"
    EXPIRED = "expired"


class ReleaseReader(EveryPartitionReader):
    """A daemon thread that fills `released` ({trace id: epoch seconds}) from the kill topic."""

    def __init__(
        self,
        settings: WorkerSettings,
        signing_key: bytes | None,
        *,
        horizon: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            settings,
            settings.kill_topic,
            "releases",
            log,
            horizon=settings.state_ttl if horizon is None else horizon,
            clock=clock,
        )
        # The worker's own key (settings.kill_signing_key()); None: unsigned accepted.
        self._keys = keyring(signing_key) if signing_key is not None else None
        # Read by the guard on the event loop, written by the thread: single dict operations
        # only, each atomic under the GIL.
        self.released: dict[str, float] = {}
        self.read = 0  # releases read (the metric spanguard_releases_read_total)
        self.ignored = Tally()  # records skipped, by ReleaseSkip

    def count(self, outcome: ReleaseCount) -> int:
        return getattr(self, outcome.value)

    def accept(self, value: bytes | None, appended_at: float) -> bool:
        """Take one record of the kill topic; True when it was a release, now in `released`.

        Expiry is judged at `appended_at` (the record's time in the log): a release that was
        valid when the operator sent it still re-arms a trace whose spans arrive later."""
        try:
            signal = read_signal(value, self._keys, datetime.fromtimestamp(appended_at, UTC))
        except BadSignal as bad:
            skip = ReleaseSkip(bad.kind)
            if not self.ignored[skip]:
                log.warning("kill topic: record skipped by the release reader (%s)", bad)
            self.ignored.add(skip)
            return False
        if signal.kind != "release" or signal.stops != "trace":
            # Kills and downgrades are the agents' business; a conversation's or an agent's
            # release lifts the agents' scoped kill and re-arms no trace's rules.
            return False
        try:  # read_signal checked the time; a record must still never stop the reader
            issued = datetime.fromisoformat(signal.detected_at).timestamp()
        except (TypeError, ValueError, OverflowError):
            self.ignored.add(ReleaseSkip.INVALID)
            return False
        trace_id = signal.trace_id.lower()
        if issued > self.released.get(trace_id, 0.0):
            self.released[trace_id] = issued
        self.read += 1
        if len(self.released) > MAX_RELEASES:
            self.prune(drop_oldest=len(self.released) - MAX_RELEASES)
        return True

    def prune(self, drop_oldest: int = 0) -> int:
        """Forget releases older than the horizon (and the `drop_oldest` oldest besides)."""
        cutoff = self.clock() - self.horizon
        entries = sorted(self.released.items(), key=lambda item: item[1])
        gone = [trace_id for trace_id, issued in entries if issued < cutoff]
        if drop_oldest > len(gone):
            gone = [trace_id for trace_id, _ in entries[:drop_oldest]]
        for trace_id in gone:
            self.released.pop(trace_id, None)
        return len(gone)
