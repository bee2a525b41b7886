"""The webhook agent: detections of every agent are posted to a webhook, once per trace and rule.
It reads the detections topic in its own stream, like paging, so the receiver's latency and
faults delay notifications, never kill signals."""

from __future__ import annotations

import asyncio

import faust

from spanguard.alerting.service import paged_rules, with_rule
from spanguard.streams.delivery import send_all
from spanguard.streams.wiring import Worker

__all__ = ["register"]


def register(worker: Worker) -> None:
    if worker.webhook.webhook is None:
        return  # no URL: no agent, no consumer of the detections for it
    notified, webhook = worker.notified, worker.webhook

    @worker.app.agent(worker.detections_in, name="notify-webhook")
    async def notify_webhook(stream: faust.StreamT) -> None:
        loop = asyncio.get_running_loop()
        async for event in stream.events():
            message = event.message
            trace_key = message.key or b""
            stored = notified.get(trace_key)  # one agent, one event at a time: current below
            detection = webhook.detection_to_send(message.value, paged_rules(stored))
            if detection is None:
                continue
            result = await loop.run_in_executor(None, webhook.notify, detection)
            # Delivered or not, never again for this trace and rule: a failure goes to the
            # dead letters with its reason, for a person to look at.
            notified[trace_key] = with_rule(stored, detection["rule"])
            if not result.delivered:
                reason = f"webhook {result.status}: {result.error}"
                await send_all([worker.outbox.dead_letter(message, reason)])
