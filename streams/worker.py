"""Running the Faust app as a worker process: logging, signals, exit code."""

from __future__ import annotations

import asyncio
import logging
import logging.config
import os

import faust

from spanguard.alerting.pagerduty import Pager, PagerConfigError, PagerSettings
from spanguard.kafka_security import check_aiokafka
from spanguard.logs import logging_config
from spanguard.schemas.policy import Policy
from spanguard.streams.app import create_app
from spanguard.streams.goal import GoalSettings
from spanguard.streams.settings import SettingsError, WorkerSettings
from spanguard.streams.verifier import GoalVerifier

__all__ = ["run_worker"]


def _pager_from_env(policy: Policy) -> Pager | None:
    """A Pager when a routing key is configured; without one, paging is off (and said so)."""
    if not (
        os.environ.get("SPANGUARD_PAGERDUTY_ROUTING_KEY")
        or os.environ.get("SPANGUARD_PAGERDUTY_ROUTING_KEY_FILE")
    ):
        if policy.defaults.autonomous or any(rule.policy.autonomous for rule in policy.rules):
            logging.getLogger("spanguard.worker").warning(
                "the policy has autonomous agents but no PagerDuty routing key is set:"
                " their detections will not page (SPANGUARD_PAGERDUTY_ROUTING_KEY)"
            )
        return None
    try:
        return Pager(PagerSettings.from_env())
    except PagerConfigError as exc:
        raise SettingsError(f"PagerDuty: {exc}") from None


def check_broker(settings: WorkerSettings, timeout: float = 15.0) -> None:
    """Fail fast on a wrong password or an untrusted certificate (KafkaConnectError): Faust
    would retry those forever. A loop of its own, so Faust's later one is untouched."""
    logging.getLogger("aiokafka").setLevel(logging.WARNING)  # as in Faust's logging config
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(check_aiokafka(settings.bootstrap, settings.kafka, timeout))
    finally:
        loop.close()


def run_worker(settings: WorkerSettings, policy: Policy) -> int:
    # JSON logs from the first line on (Faust applies the same config again when it starts).
    logging.config.dictConfig(logging_config(settings.log_level))
    verifier = GoalVerifier(policy, GoalSettings.from_env())
    if not verifier.settings.enabled and (
        policy.defaults.goal_enabled or any(rule.policy.goal_enabled for rule in policy.rules)
    ):
        logging.getLogger("spanguard.worker").warning(
            "the policy turns the goal verifier on but no judge is configured"
            " (SPANGUARD_JUDGE_URL and SPANGUARD_JUDGE_MODEL): no goal checks"
        )
    pager = _pager_from_env(policy)
    check_broker(settings)
    app = create_app(settings, policy, pager=pager, verifier=verifier)
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
            "kafka": settings.kafka.describe(),  # never a password
            "input": [settings.input_topic, settings.repartition_topic],
            "store": settings.store,
            "state_ttl": settings.state_ttl,
        },
    )
    # mode's Worker handles SIGTERM and SIGINT: it stops the agents, flushes the producer,
    # commits offsets and exits.
    worker.execute_from_commandline()
    return 0
