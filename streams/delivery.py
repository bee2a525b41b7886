"""What the worker sends, and how: acks=all with retries, signed kill signals, dead letters that
point back at their source (docs/design.md, "Delivery: no lost kill")."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from spanguard.detection.pipeline import MAX_RECORD_BYTES, Outcome
from spanguard.schemas.decision import Decision, KillSignal, kill_signals, sign
from spanguard.streams.partitioner import collector_partition

__all__ = [
    "MAX_DEAD_LETTER_BYTES",
    "SEND_ATTEMPTS",
    "Outbox",
    "Produced",
    "RecordTooLarge",
    "Send",
    "confirm",
    "delivery_error",
    "produce",
    "send_all",
]

log = logging.getLogger("spanguard.worker")

# Dead letters carry where they came from, so an operator can find and replay them.
HEADER_REASON = "spanguard.reason"
HEADER_TOPIC = "spanguard.source.topic"
HEADER_PARTITION = "spanguard.source.partition"
HEADER_OFFSET = "spanguard.source.offset"
# A dead letter must fit the topic's default max.message.bytes (1 MiB) with its headers.
MAX_DEAD_LETTER_BYTES = MAX_RECORD_BYTES
SEND_ATTEMPTS = 4
# A dead letter's reason header stays short whatever the error says.
MAX_REASON_CHARS = 300


@dataclass
class Send:
    """One record to send; a kill signal remembers its decision, to retract it if not sent,
    other records their source message, to dead-letter a pointer to it if not sent.

    A `deferred` record carries no decision (a repartition pack, a conversation pack, an
    agent usage record): it is produced at once and its ack waits for the next state flush,
    before its source message is acked (docs/design.md, "Records acked at the flush")."""

    topic: Any
    kwargs: dict[str, Any]
    decision: Decision | None = None
    source: Any = None
    deferred: bool = False


class RecordTooLarge(Exception):
    """Over the record limit: refused on every attempt, so it fails at once."""


# What the producer made of a send: its delivery future, or the exception that refused it.
Produced = Awaitable[Any] | BaseException


async def produce(sends: list[Send]) -> list[Produced]:
    """Hand each send to the producer without waiting for the broker; aligned with `sends`.

    One producer sends a partition's records in the order they are handed over (aiokafka has
    one request in flight per broker and retries a failed batch ahead of later ones), so
    records not yet acked keep their order on their partition."""
    produced: list[Produced] = []
    for send in sends:
        size = len(send.kwargs.get("value") or b"")
        if size > MAX_RECORD_BYTES:
            log.warning(
                "record too large to send",
                extra={"topic": send.topic.get_topic_name(), "bytes": size},
            )
            produced.append(RecordTooLarge(f"{size} bytes, over {MAX_RECORD_BYTES}"))
            continue
        try:
            produced.append(await send.topic.send(**send.kwargs))
        except Exception as exc:  # the producer refused it: counts as a failed send  # noqa: BLE001
            produced.append(exc)
    return produced


async def delivery_error(produced: Produced) -> BaseException | None:
    """None once the broker acked the record (acks=all), else why it was not written."""
    if isinstance(produced, BaseException):
        return produced
    try:
        await produced
    # The ack's failure, whatever it is, is the send's outcome (counted by the caller).
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


async def confirm(sends: list[Send], produced: list[Produced]) -> list[Send]:
    """Wait for the broker's acks of `sends` (as `produce` handed them over), sending again
    those that failed; return the sends that failed for good."""
    final: list[Send] = []  # too large: no attempt can write them
    pending, futures = sends, produced
    for attempt in range(SEND_ATTEMPTS):
        failed = []
        for send, future in zip(pending, futures, strict=True):
            error = await delivery_error(future)
            if error is None:
                continue
            if isinstance(error, RecordTooLarge):
                final.append(send)
                continue
            log.warning(
                "send failed",
                extra={
                    "topic": send.topic.get_topic_name(),
                    "attempt": attempt + 1,
                    "error": repr(error),
                },
            )
            failed.append(send)
        pending = failed
        if not pending or attempt == SEND_ATTEMPTS - 1:
            break
        await asyncio.sleep(0.2 * 2**attempt)
        futures = await produce(pending)
    return final + pending


async def send_all(sends: list[Send]) -> list[Send]:
    """Send, then wait for the broker's acks=all; return the sends that failed for good."""
    return await confirm(sends, await produce(sends))


class Outbox:
    """Turns an outcome into the records it sends: repartitioned parts, detections, signed kill
    signals, dead letters."""

    def __init__(
        self,
        *,
        repartition: Any,
        detections: Any,
        kill_signals: Any,
        dead_letters: Any,
        partitions: int,
        signing_key: bytes | None,
        on_decision: Callable[[Decision], None] | None = None,
        tool_signals: Callable[[Decision], list[KillSignal]] | None = None,
    ) -> None:
        """`on_decision`: told of every decision sent, of every scope (the metrics' spend).
        `tool_signals`: the signals a fleet incident sends besides (its contain and release,
        spanguard/detection/fleet_signals.py), where the policy's fleet section contains."""
        self.on_decision = on_decision
        self.tool_signals = tool_signals
        self.repartition = repartition
        self.detections = detections
        self.kill_signals = kill_signals
        self.dead_letters = dead_letters
        self.partitions = partitions
        self.signing_key = signing_key

    def dead_letter(self, message: Any, reason: str, value: bytes | None = None) -> Send:
        """`message` (or `value` in its place) with the reason and its source as headers."""
        value = message.value if value is None else value
        if value is not None and len(value) > MAX_DEAD_LETTER_BYTES:
            value = b""  # too large for the topic: the headers point at the source offset
        log.warning(
            "dead letter",
            extra={
                "reason": reason,
                "topic": message.topic,
                "partition": message.partition,
                "offset": message.offset,
            },
        )
        headers = [
            (HEADER_REASON, reason.encode()),
            (HEADER_TOPIC, message.topic.encode()),
            (HEADER_PARTITION, str(message.partition).encode()),
            (HEADER_OFFSET, str(message.offset).encode()),
        ]
        return Send(self.dead_letters, {"key": message.key, "value": value, "headers": headers})

    def pointers_to_unsent(
        self, failed: list[Send], errors: list[BaseException] | None = None
    ) -> list[Send]:
        """A record that could not be written (too large, say) leaves a dead letter that
        points at its source message; `errors`, aligned with `failed`, say why."""
        pointers = []
        for index, send in enumerate(failed):
            if send.source is None:
                continue
            topic = send.topic.get_topic_name()
            if errors is None:
                reason = f"could not be written to {topic} after {SEND_ATTEMPTS} attempts"
            else:
                reason = f"could not be written to {topic}: {errors[index]!r}"[:MAX_REASON_CHARS]
            pointer = self.dead_letter(send.source, reason, send.kwargs.get("value") or b"")
            pointer.kwargs["key"] = send.kwargs.get("key")
            pointers.append(pointer)
        return pointers

    def repartition_sends(self, parts: list[tuple[str, bytes]], message: Any) -> list[Send]:
        """One record per partition the parts go to, holding every trace bound for it.

        Serialized ExportTraceServiceRequests concatenate into one request (protobuf merges
        repeated fields), so packing copies bytes and parses nothing. A record holds up to
        MAX_RECORD_BYTES; a lone trace keeps its trace id as the key, a pack has none (the
        worker decides it in place because every trace in it lives on that partition). A record
        that cannot be written leaves a dead letter pointing at `message`, the source."""
        packs: dict[int, list[tuple[str, bytes]]] = {}
        for trace_id, part in parts:
            packs.setdefault(collector_partition(trace_id.encode(), self.partitions), []).append(
                (trace_id, part)
            )
        sends: list[Send] = []
        for partition, members in packs.items():
            chunk: list[tuple[str, bytes]] = []
            size = 0
            for trace_id, part in members:
                if chunk and size + len(part) > MAX_RECORD_BYTES:
                    sends.append(self._pack(chunk, partition, message))
                    chunk, size = [], 0
                chunk.append((trace_id, part))
                size += len(part)
            sends.append(self._pack(chunk, partition, message))
        return sends

    def _pack(self, chunk: list[tuple[str, bytes]], partition: int, message: Any) -> Send:
        key = chunk[0][0].encode() if len(chunk) == 1 else None
        value = b"".join(part for _, part in chunk)
        kwargs = {"key": key, "value": value, "partition": partition}
        return Send(self.repartition, kwargs, source=message, deferred=True)

    def sends_for(self, outcome: Outcome, message: Any) -> list[Send]:
        sends: list[Send] = self.repartition_sends(outcome.repartition, message)
        for decision in outcome.decisions:
            if self.on_decision is not None:
                self.on_decision(decision)
            key = decision.trace_id.encode()
            sends.append(Send(self.detections, {"key": key, "value": decision.to_json().encode()}))
            # A flag is for people, not agents; a conversation kill also stops the
            # conversation's later traces (a second, scoped signal).
            signals = kill_signals(decision)
            if self.tool_signals is not None:
                signals += self.tool_signals(decision)
            for signal in signals:
                record = signal.to_dict()
                if self.signing_key is not None:
                    record = sign(record, self.signing_key)
                value = json.dumps(record, sort_keys=True).encode()
                kwargs = {"key": signal.topic_key(), "value": value}
                sends.append(Send(self.kill_signals, kwargs, decision))
            log.warning(
                "decision",
                extra={
                    "trace_id": decision.trace_id,
                    "rule": decision.rule,
                    "action": decision.action,
                    "reason": decision.reason,
                    "service": decision.agent.service,
                },
            )
        if outcome.dead_letter is not None:
            sends.append(self.dead_letter(message, outcome.dead_letter, outcome.dead_value))
        return sends
