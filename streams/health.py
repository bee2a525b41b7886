"""Liveness and readiness that mean something: the span agent runs and makes progress.

/metrics answering proves only that the event loop turns. Readiness is red from the moment the
span agent crashes until it completes a batch again. Liveness turns red, so the orchestrator
restarts the worker, when the agent has stayed crashed for `dead_after` seconds (a crash loop
counts from its first crash), or when records have been waiting on its partitions for
`dead_after` seconds without a batch completing (a stuck agent that never raises).
"""

from __future__ import annotations

import logging
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from spanguard.outcomes import CountedOutcome

__all__ = ["Health", "HealthCount", "serve_http"]

log = logging.getLogger("spanguard.worker")


class HealthCount(CountedOutcome):
    """What the span agent's health counts: each member names a counter of Health."""

    BATCHES = "batches"  # batches completed
    CRASHES = "crashes"  # times the span agent raised
    LOST_SIGNALS = "lost_signals"  # kill signals not acked by the broker (the trace can trip again)


class Health:
    def __init__(
        self, dead_after: float = 60.0, clock=time.monotonic, wall_clock=time.time
    ) -> None:
        self.clock = clock
        self.wall_clock = wall_clock
        self.dead_after = dead_after
        self.crashed_at: float | None = None
        self.last_error: str | None = None
        self.batches = 0
        self.crashes = 0
        self.lost_signals = 0
        self.pending = 0
        self.waiting_since: float | None = None  # records pending and no batch done since
        # Unix time the last batch completed: how stale the worker's decisions are, and when a
        # drain ended for a reader that scrapes once a second (bench/bench_pipeline.py).
        self.last_batch_at: float | None = None

    def count(self, outcome: HealthCount) -> int:
        return getattr(self, outcome.value)

    def progressed(self) -> None:
        self.batches += 1
        self.last_batch_at = self.wall_clock()
        self.crashed_at = None
        self.waiting_since = None

    def crashed(self, exc: BaseException) -> None:
        self.crashes += 1
        if self.crashed_at is None:  # a restarted agent crashing again is the same outage
            self.crashed_at = self.clock()
        self.last_error = f"{type(exc).__name__}: {exc}"[:500]
        log.error("the span agent crashed", extra={"error": self.last_error})

    def observe_pending(self, pending: int) -> None:
        """Records waiting on the agent's partitions (highwater minus where it got to)."""
        self.pending = pending
        if pending <= 0:
            self.waiting_since = None
        elif self.waiting_since is None:
            self.waiting_since = self.clock()

    @property
    def ready(self) -> bool:
        return self.crashed_at is None

    @property
    def stalled(self) -> bool:
        return self.waiting_since is not None and (
            self.clock() - self.waiting_since >= self.dead_after
        )

    @property
    def live(self) -> bool:
        crashed_too_long = (
            self.crashed_at is not None and self.clock() - self.crashed_at >= self.dead_after
        )
        return not crashed_too_long and not self.stalled

    def report(self) -> dict[str, object]:
        return {
            "ready": self.ready,
            "live": self.live,
            "stalled": self.stalled,
            "pending": self.pending,
            "batches": self.batches,
            "crashes": self.crashes,
            "lost_signals": self.lost_signals,
            "last_error": self.last_error,
        }


async def serve_http(
    health: Health, registry: CollectorRegistry, host: str, port: int
) -> web.AppRunner:
    """/metrics, /livez and /readyz on one port."""

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def livez(_: web.Request) -> web.Response:
        return web.json_response(health.report(), status=200 if health.live else 503)

    async def readyz(_: web.Request) -> web.Response:
        return web.json_response(health.report(), status=200 if health.ready else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
