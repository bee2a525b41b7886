"""The worker's lease in tests (tests/streams): a clock of the test's own, the session timeout,
and the scope agents' batches under a lapsed lease."""

from __future__ import annotations

import asyncio
from typing import Any

SESSION = 30.0  # the session timeout the tests' leases run on


class Clock:
    """The lease's clock, moved by the test (`clock.now += SESSION`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def wait_empty() -> None:
    """Faust's wait for every message to be acked, as the agents wrap it: nothing to wait for."""


def batch_frozen_then_revoked(
    spans: Any, agent: Any, events: list[Any], clock: Any, lapse: float
) -> None:
    """Run `agent`'s batch of `events` as if woken from a freeze `lapse` seconds long (past the
    session timeout): the batch must wait on the lapsed lease; then the partitions are revoked
    (Faust's wait for every message, wrapped by the span agent and `agent` as attach() does)
    and the batch ends."""

    async def frozen_then_revoked() -> None:
        clock.now += lapse  # woken from a freeze past the session timeout
        batch = asyncio.ensure_future(agent.guard_batch(events))
        await asyncio.sleep(0.3)
        assert not batch.done(), "a batch under a lapsed lease went on"

        await spans.write_back.flush_before_waiting(
            agent.write_back.flush_before_waiting(wait_empty)
        )()
        await asyncio.wait_for(batch, 2)

    asyncio.run(frozen_then_revoked())
