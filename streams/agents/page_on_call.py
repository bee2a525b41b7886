"""The paging agent: detections of autonomous agents become PagerDuty incidents, once per trace
and rule. It reads the detections topic in its own stream, so PagerDuty's latency and faults
delay pages, never kill signals."""

from __future__ import annotations

import asyncio

import faust

from spanguard.alerting.service import paged_rules, with_rule
from spanguard.streams.delivery import send_all
from spanguard.streams.wiring import Worker

__all__ = ["register"]


def register(worker: Worker) -> None:
    paged, paging = worker.paged, worker.paging

    @worker.app.agent(worker.detections_in, name="page-on-call")
    async def page_on_call(stream: faust.StreamT) -> None:
        loop = asyncio.get_running_loop()
        async for event in stream.events():
            message = event.message
            trace_key = message.key or b""
            stored = paged.get(trace_key)  # one agent, one event at a time: still current below
            detection = paging.detection_to_page(message.value, paged_rules(stored))
            if detection is None:
                continue
            result = await loop.run_in_executor(None, paging.page, detection)
            # Delivered or not, never again for this trace and rule: a failure goes to the
            # dead letters with its reason, for a person to look at.
            paged[trace_key] = with_rule(stored, detection["rule"])
            if not result.delivered:
                reason = f"page {result.status}: {result.error}"
                await send_all([worker.outbox.dead_letter(message, reason)])
