"""Running the Faust app as a worker process: logging, signals, exit code."""

from __future__ import annotations

import asyncio
import logging
import logging.config
from dataclasses import replace

import faust

from spanguard.alerting.pagerduty import Pager
from spanguard.alerting.webhook import Webhook
from spanguard.config.settings import (
    GoalSettings,
    PagerSettings,
    WebhookSettings,
    WorkerSettings,
    logger_levels,
)
from spanguard.connectors.judge import OpenAICompatibleJudge
from spanguard.connectors.kafka_clients import check_aiokafka
from spanguard.connectors.topics import cluster_replication, with_scope_partitions_found
from spanguard.detection import core_build
from spanguard.goal.verifier import GoalVerifier
from spanguard.logs import logging_config
from spanguard.schemas.policy import Policy
from spanguard.streams.app import create_app

__all__ = ["run_worker"]


def check_broker(settings: WorkerSettings, timeout: float = 15.0) -> None:
    """Fail fast on a wrong password or an untrusted certificate (KafkaConnectError): Faust
    would retry those forever. A loop of its own, so Faust's later one is untouched."""
    logging.getLogger("aiokafka").setLevel(logging.WARNING)  # as in Faust's logging config
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(check_aiokafka(settings.bootstrap, settings.kafka, timeout))
    finally:
        loop.close()


def warn_unconfigured(
    policy: Policy, goal: GoalSettings, pager: PagerSettings | None, log: logging.Logger
) -> None:
    """What the policy asks for and the settings cannot do: said once, at start."""
    if not goal.enabled and (
        policy.defaults.goal.enabled or any(rule.policy.goal.enabled for rule in policy.rules)
    ):
        log.warning(
            "the policy turns the goal verifier on but no judge is configured"
            " (SPANGUARD_JUDGE_URL and SPANGUARD_JUDGE_MODEL): no goal checks"
        )
    if pager is None and (
        policy.defaults.autonomous or any(rule.policy.autonomous for rule in policy.rules)
    ):
        log.warning(
            "the policy has autonomous agents but no PagerDuty routing key is set:"
            " their detections will not page (SPANGUARD_PAGERDUTY_ROUTING_KEY)"
        )


def run_worker(
    settings: WorkerSettings,
    policy: Policy,
    goal: GoalSettings | None = None,
    pager: PagerSettings | None = None,
    webhook: WebhookSettings | None = None,
) -> int:
    # JSON logs from the first line on (Faust applies the same config again when it starts).
    log_config = logging_config(settings.log_level, logger_levels(settings.log_levels))
    logging.config.dictConfig(log_config)
    log = logging.getLogger("spanguard.worker")
    if settings.mode == "observe":
        # Shadow mode for the whole fleet: decisions are recorded and notified, never sent.
        policy = policy.observed()
        log.warning("observe mode: every decision is a flag, no signal is sent to agents")
    goal = goal or GoalSettings()
    verifier = GoalVerifier(
        policy,
        goal,
        judge_factory=lambda model: OpenAICompatibleJudge.from_settings(replace(goal, model=model)),
    )
    warn_unconfigured(policy, goal, pager, log)
    check_broker(settings)
    settings = with_scope_partitions_found(settings)
    if settings.replication_factor == 0:
        # Topics Faust makes itself (its assignor's) get the replication `topics create` chose.
        replication = cluster_replication(settings)
        log.info("topics Faust creates: %s", replication.describe())
        settings = replace(settings, replication_factor=replication.factor)
    app = create_app(
        settings,
        policy,
        pager=Pager(pager) if pager else None,
        verifier=verifier,
        webhook=Webhook(webhook) if webhook else None,
    )
    worker = faust.Worker(
        app,
        loglevel=settings.log_level,
        logging_config=log_config,
        quiet=True,  # no banner on stdout: logs are JSON on stderr
    )
    log.info(
        "starting",
        extra={
            "bootstrap": settings.bootstrap,
            "kafka": settings.kafka.describe(),  # never a password
            "input": [settings.input_topic, settings.repartition_topic],
            "store": settings.store,
            "state_ttl": settings.state_ttl,
            "detection_core": core_build(),  # compiled in the image, pure Python otherwise
        },
    )
    # mode's Worker handles SIGTERM and SIGINT: it stops the agents, flushes the producer,
    # commits offsets and exits.
    worker.execute_from_commandline()
    return 0
