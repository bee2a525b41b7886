"""Acknowledgements: an agent that obeys a kill or a downgrade says so.

When `KillSwitch.check()` raises `AgentKilled` for a signal, or hands over a downgrade's
message, it writes one small record per signal to the ack topic (`agent-kill-acks`, keyed by
trace id), signed like the signals (HMAC-SHA256 with the agent's current key, `key_id`):

    {"kind": "ack", "trace_id": ..., "signal_id": ..., "action": "kill" | "downgrade",
     "process": "host:pid", "obeyed_at": ISO-8601, "key_id": ..., "signature": ...}

`spanguard explain` reads them back and says, per signal: obeyed (by which process, how long
after the decision), not obeyed within N seconds, or still pending. Writing is
fire-and-forget: an ack that cannot be written is logged once and never delays the agent.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from spanguard.schemas.decision import KillSignal, sign, verify

__all__ = ["ACK_KIND", "DEFAULT_ACK_TOPIC", "AckSender", "ack_record", "ack_status"]

ACK_KIND = "ack"
DEFAULT_ACK_TOPIC = "agent-kill-acks"

log = logging.getLogger("spanguard.killswitch")


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def ack_record(
    signal: KillSignal, *, obeyed_at: datetime, key: bytes | None, process: str | None = None
) -> dict[str, Any]:
    """The ack of `signal`, signed with `key` (unsigned when None: an unsigned deployment)."""
    record = {
        "kind": ACK_KIND,
        "trace_id": signal.trace_id.lower(),
        "signal_id": signal.signal_id,
        "action": signal.kind,
        "process": process or this_process(),
        "obeyed_at": obeyed_at.isoformat(timespec="milliseconds"),
    }
    return sign(record, key) if key is not None else record


def ack_status(record: Mapping[str, Any], keys: Mapping[str, bytes] | None) -> str:
    """ "valid", "unsigned", "unknown_key" or "forged" ("unchecked" without keys)."""
    if not keys:
        return "unchecked"
    return verify(record, keys)


class AckSender:
    """A producer made on the first ack (most agents are never killed), fire-and-forget."""

    def __init__(self, topic: str, config: Mapping[str, Any]) -> None:
        self.topic = topic
        self._config = dict(config)
        self._producer: Any = None
        self._lock = threading.Lock()
        self.sent = 0
        self.failed = 0

    def send(self, record: Mapping[str, Any]) -> None:
        import json

        from confluent_kafka import Producer

        with self._lock:
            try:
                if self._producer is None:
                    self._producer = Producer({**self._config, "linger.ms": 0})
                self._producer.produce(
                    self.topic,
                    key=str(record["trace_id"]).encode(),
                    value=json.dumps(record, sort_keys=True).encode(),
                    on_delivery=self._delivered,
                )
                self._producer.poll(0)
            # Never the agent's problem: its tool call is stopped.
            except Exception as exc:  # noqa: BLE001
                self._failed(str(exc))

    def _delivered(self, error: Any, message: Any) -> None:
        if error is not None:
            self._failed(str(error))
        else:
            self.sent += 1

    def _failed(self, why: str) -> None:
        self.failed += 1
        if self.failed == 1:
            log.warning(
                "spanguard killswitch: an ack could not be written to %s (%s); `explain` will"
                " show the signal as not acknowledged (further failures counted in"
                " KillSwitch.acks.failed)",
                self.topic,
                why,
            )

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            if self._producer is not None:
                self._producer.flush(timeout)
