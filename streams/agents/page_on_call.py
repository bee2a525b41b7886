"""The paging agent: detections of autonomous agents become PagerDuty incidents, once per trace
and rule. It reads the detections topic in its own stream, so PagerDuty's latency and faults
delay pages, never kill signals."""

from __future__ import annotations

import faust

from spanguard.streams.agents.once_per_rule import deliver_once_per_rule
from spanguard.streams.wiring import Worker

__all__ = ["register"]


def register(worker: Worker) -> None:
    paging = worker.paging

    @worker.app.agent(worker.detections_in, name="page-on-call")
    async def page_on_call(stream: faust.StreamT) -> None:
        await deliver_once_per_rule(
            worker, stream, worker.paged, paging.detection_to_page, paging.page, "page"
        )
