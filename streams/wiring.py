"""What the agents share: the app, its topics and tables, the guard and the outbox."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import faust
from prometheus_client import CollectorRegistry

from spanguard.alerting.service import PagingService
from spanguard.alerting.webhook import WebhookService
from spanguard.detection.guard import Guard
from spanguard.detection.pipeline import SpanPipeline
from spanguard.goal.verifier import GoalVerifier
from spanguard.settings import WorkerSettings
from spanguard.streams.delivery import Outbox
from spanguard.streams.health import Health
from spanguard.streams.metrics import ConsumerLag, DetectionLatency
from spanguard.streams.state import SerializedStates

__all__ = ["Worker"]


@dataclass
class Worker:
    app: faust.App
    settings: WorkerSettings
    spans_in: Any  # the Collector's topic and the repartition topic
    goal_checks: Any
    detections_in: Any
    table: Any  # trace id -> TraceState bytes
    paged: Any  # trace id -> rules already paged
    notified: Any  # trace id -> rules already sent to the webhook
    states: SerializedStates
    guard: Guard
    pipeline: SpanPipeline
    outbox: Outbox
    health: Health
    paging: PagingService
    webhook: WebhookService
    verifier: GoalVerifier | None
    registry: CollectorRegistry  # what /metrics serves
    latency: DetectionLatency
    lag: ConsumerLag
    http: Any = None  # the /metrics, /livez, /readyz server, kept while the app runs
