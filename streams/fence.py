"""The worker's lease on its partitions: a zombie (frozen, or cut off from the brokers, past its
session timeout) must not decide, write state or ack what it fetched before its partitions moved.

The group coordinator evicts a member whose heartbeats stop for the session timeout and gives its
partitions to the others; the evicted member learns it only from its next heartbeat or commit.
Until then it would go on as the owner: send what its batch decided, and write that batch's
state to the changelog after (so over) the state the new owner wrote. The lease closes that
window from our side: a heartbeat the coordinator answered at time t keeps the member in the
group until at least t + session timeout (the coordinator received it after t), so the worker
holds its partitions until `t + session timeout x LEASE_SHARE` and acts only while it does.
A frozen process finds its lease lapsed on waking (the monotonic clock runs on through SIGSTOP),
a cut-off one once its heartbeats have failed for that long. A lapsed lease either comes back
(a late heartbeat answered: nothing moved, the batch goes on) or ends in a revocation that finds
it lapsed: then the partitions are fenced, and what was fetched and decided under them is
dropped unwritten and unacked, for the new owner to decide again from the committed offsets and
the changelog.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from spanguard.streams.faust_internals import heartbeat_rejoining, wrap_heartbeat

__all__ = ["LEASE_SHARE", "Lease"]

log = logging.getLogger("spanguard.worker")

# Share of the session timeout a heartbeat's answer holds the partitions for: the rest covers a
# record written just before the lease lapses and reaching its broker a little later.
LEASE_SHARE = 0.8
# Seconds between two looks at a lapsed lease.
LEASE_POLL = 0.05


class Lease:
    """When this worker last knew it owned its partitions, and how many times it was fenced.

    `renewed()` is called from the consumer's own thread (the heartbeat), the rest from the
    event loop: the one value they share is a float, replaced whole."""

    def __init__(self, session_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold = session_timeout * LEASE_SHARE
        self.clock = clock
        self.valid_until = 0.0
        self.owned = False  # nothing before the first assignment, nor once fenced
        self.epoch = 0  # fenced revocations so far: a batch of an older epoch is dropped
        self.fenced = 0
        self.rejoined_after = 0.0
        self._coordinator: Any = None

    def rebalance_began(self) -> None:
        """This member is about to (re)join the group: an assignment it gets back was answered
        after now."""
        self.rejoined_after = self.clock()

    def assigned(self, coordinator: Any) -> None:
        """Partitions assigned by the rebalance that began at `rebalance_began`."""
        self.watch(coordinator)
        self.owned = True
        self.renewed(self.rejoined_after)

    def renewed(self, answered_after: float) -> None:
        """The coordinator answered a heartbeat (or an assignment) sent at `answered_after`."""
        self.valid_until = max(self.valid_until, answered_after + self.hold)

    def held(self) -> bool:
        return self.owned and self.clock() < self.valid_until

    def holds(self, epoch: int) -> bool:
        """The partitions a batch of `epoch` was fetched under are still this worker's."""
        return epoch == self.epoch and self.held()

    async def wait(self, epoch: int) -> bool:
        """True once the lease holds for `epoch` (at once, mostly), False once it is fenced or
        nothing is owned (fenced, before the next assignment)."""
        waited = False
        while epoch == self.epoch and self.owned and not self.held():
            if not waited:
                waited = True
                log.warning(
                    "lease on the partitions lapsed: waiting for a heartbeat or a rebalance",
                    extra={"lapsed_for": round(self.clock() - self.valid_until, 1)},
                )
            await asyncio.sleep(LEASE_POLL)
        if waited and self.holds(epoch):
            log.info("lease renewed: the batch goes on")
        return self.holds(epoch)

    def fence_if_lapsed(self) -> bool:
        """At a revocation: True (and a new epoch) if the partitions may already be another
        worker's, because the lease lapsed or the coordinator no longer knows this member."""
        evicted = (
            self._coordinator is not None and getattr(self._coordinator, "generation", 0) < 0
        )  # aiokafka resets it to -1 when told the member is unknown
        if not self.owned or (self.held() and not evicted):
            return False  # fenced already, or still the owner: a rebalance like any other
        self.epoch += 1
        self.fenced += 1
        self.owned = False  # until the next assignment: a batch taken meanwhile is dropped
        log.warning(
            "fenced: the partitions may already be another worker's; what was fetched and"
            " decided under them is dropped, unwritten and unacked",
            extra={"evicted": evicted, "epoch": self.epoch},
        )
        return True

    def watch(self, coordinator: Any) -> None:
        """Renew the lease on each heartbeat the coordinator answers (aiokafka's
        GroupCoordinator; its heartbeat routine calls one method for each one)."""
        if coordinator is None or coordinator is self._coordinator:
            return
        self._coordinator = coordinator
        lease = self

        def renewing_lease(beat: Callable[[], Awaitable[bool]]) -> Callable[[], Awaitable[bool]]:
            async def heartbeat_renewing_lease() -> bool:
                sent = lease.clock()
                answered = await beat()
                # True is also "rebalancing, keep heartbeating": that one renews nothing, as
                # the rebalance may end without this member if it does not rejoin in time.
                rejoining = heartbeat_rejoining(coordinator)
                if answered and not rejoining and getattr(coordinator, "generation", 0) >= 0:
                    lease.renewed(sent)
                return answered

            return heartbeat_renewing_lease

        wrap_heartbeat(coordinator, renewing_lease)
