"""The webhook agent: detections of every agent are posted to a webhook, once per trace and rule.
It reads the detections topic in its own stream, like paging, so the receiver's latency and
faults delay notifications, never kill signals."""

from __future__ import annotations

import faust

from spanguard.streams.agents.once_per_rule import deliver_once_per_rule
from spanguard.streams.wiring import Worker

__all__ = ["register"]


def register(worker: Worker) -> None:
    webhook, notified = worker.webhook, worker.notified
    if webhook.webhook is None or notified is None:
        return  # no URL: no agent, no consumer of the detections for it

    @worker.app.agent(worker.detections_in, name="notify-webhook")
    async def notify_webhook(stream: faust.StreamT) -> None:
        await deliver_once_per_rule(
            worker, stream, notified, webhook.detection_to_send, webhook.notify, "webhook"
        )
