"""Running the Faust app as a worker process: logging, signals, exit code."""

from __future__ import annotations

import logging

import faust

from spanguard.logs import logging_config
from spanguard.schemas.policy import Policy
from spanguard.streams.app import create_app
from spanguard.streams.settings import WorkerSettings

__all__ = ["run_worker"]


def run_worker(settings: WorkerSettings, policy: Policy) -> int:
    app = create_app(settings, policy)
    worker = faust.Worker(
        app,
        loglevel=settings.log_level,
        logging_config=logging_config(settings.log_level),
        quiet=True,  # no banner on stdout: logs are JSON on stderr
    )
    logging.getLogger("spanguard.worker").info(
        "starting",
        extra={
            "bootstrap": settings.bootstrap,
            "input": [settings.input_topic, settings.repartition_topic],
            "store": settings.store,
            "state_ttl": settings.state_ttl,
        },
    )
    # mode's Worker handles SIGTERM and SIGINT: it stops the agents, flushes the producer,
    # commits offsets and exits.
    worker.execute_from_commandline()
    return 0
