"""The worker's parts that run beside its agents: lag readings, /metrics, start-up housekeeping.

Each is a small class whose `attach` registers its methods as Faust tasks or timers. Tasks,
not mode services started with the app: Faust starts tasks once the first table recovery is
done, so /readyz answers (and the start-up objects are frozen) only from then on.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from spanguard.streams.health import serve_http

if TYPE_CHECKING:
    import faust

    from spanguard.streams.wiring import Worker

__all__ = ["LAG_INTERVAL", "LagMeter", "MetricsServer", "StartupTasks"]

log = logging.getLogger("spanguard.worker")

# Seconds between two readings of the consumer lag (a scrape reads the last one).
LAG_INTERVAL = 5.0


class LagMeter:
    """Reads the consumer lag of the topics the agents consume, every LAG_INTERVAL seconds."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        settings = worker.settings
        self.consumed = {
            settings.input_topic,
            settings.repartition_topic,
            settings.detections_topic,
            settings.goal_topic,
        }
        if worker.conversations_out is not None:
            self.consumed.add(settings.conversation_topic)
        if worker.agent_usage_out is not None:
            self.consumed.add(settings.agent_usage_topic)
        if worker.tool_calls_out is not None:
            self.consumed.add(settings.tool_calls_topic)

    def attach(self, app: faust.App) -> None:
        app.timer(interval=LAG_INTERVAL)(self.measure_lag)

    async def measure_lag(self) -> None:
        try:
            await self.worker.lag.refresh(self.worker.app.consumer, self.consumed)
        # Not started, or mid-rebalance: the next tick tries again.
        except Exception as exc:  # noqa: BLE001
            log.debug("consumer lag not read", extra={"error": repr(exc)})


class MetricsServer:
    """/metrics, /livez and /readyz on the settings' host and port; `runner` while it serves."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.runner: web.AppRunner | None = None

    def attach(self, app: faust.App) -> None:
        app.task(self.serve_metrics)

    async def serve_metrics(self) -> None:
        worker, settings = self.worker, self.worker.settings
        self.runner = await serve_http(
            worker.health, worker.registry, settings.metrics_host, settings.metrics_port
        )
        log.info(
            "metrics",
            extra={"url": f"http://{settings.metrics_host}:{settings.metrics_port}/metrics"},
        )


class StartupTasks:
    """What runs once the app is up: the release and incident readers start, start-up objects
    are frozen."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def attach(self, app: faust.App) -> None:
        app.task(self.freeze_startup_objects)
        app.task(self.read_releases)
        app.task(self.read_incidents)

    async def freeze_startup_objects(self) -> None:
        # Tasks start once the first table recovery is done: what the process holds now
        # (modules, Faust's and aiokafka's services) lives as long as it does. Frozen, full
        # collections walk only what came later, a fraction of the pause (docs/performance.md,
        # "Figures behind the code").
        gc.collect()
        gc.freeze()
        log.info("startup objects frozen", extra={"objects": gc.get_freeze_count()})

    async def read_releases(self) -> None:
        self.worker.releases.start()  # a daemon thread: it ends with the process

    async def read_incidents(self) -> None:
        self.worker.incident_reader.start()  # a daemon thread, likewise
