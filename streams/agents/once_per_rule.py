"""The loop the paging and webhook agents share: each detection is delivered at most once per
trace and rule (a fleet incident's recovery apart from its opening), remembered in a changelog-backed table, and a failed delivery is dead-lettered."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import faust
from faust.types import TableT

from spanguard.alerting.incidents import delivery_mark
from spanguard.alerting.pagerduty import PageResult
from spanguard.alerting.service import paged_rules, with_rule
from spanguard.alerting.webhook import NotifyResult
from spanguard.schemas.decision import Decision
from spanguard.streams.delivery import send_all
from spanguard.streams.wiring import Worker

__all__ = ["deliver_once_per_rule"]


async def deliver_once_per_rule(
    worker: Worker,
    stream: faust.StreamT,
    table: TableT,
    choose: Callable[[bytes | None, set[str]], Decision | None],
    deliver: Callable[[Decision], PageResult | NotifyResult],
    what: str,
) -> None:
    """`choose(value, rules already delivered)` picks the detection to deliver (or None);
    `deliver(detection)` runs off the event loop and returns a result with `delivered`,
    `status` and `error`; `what` names the delivery in a dead letter's reason."""
    loop = asyncio.get_running_loop()
    async for event in stream.events():
        message = event.message
        trace_key = message.key or b""
        stored = table.get(trace_key)  # one agent, one event at a time: still current below
        detection = choose(message.value, paged_rules(stored))
        if detection is None:
            continue
        result = await loop.run_in_executor(None, deliver, detection)
        # Delivered or not, never again for this trace and rule: a failure goes to the
        # dead letters with its reason, for a person to look at.
        table[trace_key] = with_rule(stored, delivery_mark(detection))
        if not result.delivered:
            reason = f"{what} {result.status}: {result.error}"
            await send_all([worker.outbox.dead_letter(message, reason)])
