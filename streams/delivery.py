"""What the worker sends, and how: acks=all with retries, signed kill signals, dead letters that
point back at their source (docs/design.md, "Delivery: no lost kill")."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spanguard.detection.pipeline import MAX_RECORD_BYTES, Outcome
from spanguard.schemas.decision import Decision, kill_signals, sign
from spanguard.streams.partitioner import collector_partition

__all__ = ["MAX_DEAD_LETTER_BYTES", "SEND_ATTEMPTS", "Outbox", "Send", "send_all"]

log = logging.getLogger("spanguard.worker")

# Dead letters carry where they came from, so an operator can find and replay them.
HEADER_REASON = "spanguard.reason"
HEADER_TOPIC = "spanguard.source.topic"
HEADER_PARTITION = "spanguard.source.partition"
HEADER_OFFSET = "spanguard.source.offset"
# A dead letter must fit the topic's default max.message.bytes (1 MiB) with its headers.
MAX_DEAD_LETTER_BYTES = MAX_RECORD_BYTES
SEND_ATTEMPTS = 4


@dataclass
class Send:
    """One record to send; a kill signal remembers its decision, to retract it if not sent,
    other records their source message, to dead-letter a pointer to it if not sent."""

    topic: Any
    kwargs: dict[str, Any]
    decision: Decision | None = None
    source: Any = None


async def send_all(sends: list[Send]) -> list[Send]:
    """Send, then wait for the broker's acks=all; return the sends that failed for good."""
    # A record over the limit would be refused on every attempt: it fails at once.
    too_large = [s for s in sends if len(s.kwargs.get("value") or b"") > MAX_RECORD_BYTES]
    pending = [s for s in sends if s not in too_large] if too_large else sends
    for send in too_large:
        log.warning(
            "record too large to send",
            extra={"topic": send.topic.get_topic_name(), "bytes": len(send.kwargs["value"])},
        )
    for attempt in range(SEND_ATTEMPTS):
        futures = []
        for send in pending:
            try:
                futures.append(await send.topic.send(**send.kwargs))
            except Exception as exc:  # the producer refused it: counts as a failed send
                futures.append(exc)
        failed = []
        for send, future in zip(pending, futures, strict=True):
            error = future
            if not isinstance(future, Exception):
                try:
                    await future
                    continue
                except Exception as exc:
                    error = exc
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
    return too_large + pending


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
    ) -> None:
        """`on_decision`: told of every decision sent, of every scope (the metrics' spend)."""
        self.on_decision = on_decision
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

    def pointers_to_unsent(self, failed: list[Send]) -> list[Send]:
        """A record that could not be written (too large, say) leaves a dead letter that
        points at its source message."""
        pointers = []
        for send in failed:
            if send.source is None:
                continue
            topic = send.topic.get_topic_name()
            reason = f"could not be written to {topic} after {SEND_ATTEMPTS} attempts"
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
        return Send(
            self.repartition, {"key": key, "value": value, "partition": partition}, source=message
        )

    def sends_for(self, outcome: Outcome, message: Any) -> list[Send]:
        sends: list[Send] = self.repartition_sends(outcome.repartition, message)
        for decision in outcome.decisions:
            if self.on_decision is not None:
                self.on_decision(decision)
            key = decision.trace_id.encode()
            sends.append(Send(self.detections, {"key": key, "value": decision.to_json().encode()}))
            # A flag is for people, not agents; a conversation kill also stops the
            # conversation's later traces (a second, scoped signal).
            for signal in kill_signals(decision):
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
