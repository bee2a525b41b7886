"""What the guard remembers of one trace, and its compact serialised form (the changelog's)."""

from __future__ import annotations

import base64
import json
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CallKey", "TraceState"]

CallKey = tuple[str, str | None, str | None]


@dataclass(slots=True)
class TraceState:
    """What the guard remembers of one trace: hashes and counts, never raw arguments."""

    service: str = "unknown_service"
    agent_name: str | None = None
    # (tool name, args hash or None, result hash or None) of the last `window` calls.
    window: deque[CallKey] = field(default_factory=deque)
    counts: dict[CallKey, int] = field(default_factory=dict)
    # (tool name, args hash) of the last `polling_window` calls whose result was recorded.
    polls: deque[tuple[str, str]] = field(default_factory=deque)
    poll_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    # Oldest first; OrderedDict drops its oldest entry in O(1), a dict does not.
    recent_span_ids: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # raw ids
    recent_call_ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    inference_tokens: int | None = None
    aggregate_tokens: int = 0
    fired: set[str] = field(default_factory=set)  # "<rule>:<action>" already sent
    last_seen: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "agent_name": self.agent_name,
            "window": [list(key) for key in self.window],
            "polls": [list(key) for key in self.polls],
            # One base64 string of the 8-byte ids: a third of the size of a list of hex strings,
            # and it is written to the changelog on every update.
            "recent_span_ids": base64.b64encode(b"".join(self.recent_span_ids)).decode(),
            "recent_call_ids": list(self.recent_call_ids),
            "inference_tokens": self.inference_tokens,
            "aggregate_tokens": self.aggregate_tokens,
            "fired": sorted(self.fired),
            "last_seen": self.last_seen,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> TraceState:
        # Records written before results were read hold (tool, args hash) pairs.
        window = deque(_call_key(key) for key in record["window"])
        polls = deque((tool, digest) for tool, digest in record.get("polls", ()))
        return cls(
            service=record["service"],
            agent_name=record["agent_name"],
            window=window,
            counts=dict(Counter(window)),
            polls=polls,
            poll_counts=dict(Counter(polls)),
            recent_span_ids=OrderedDict.fromkeys(_split_ids(record["recent_span_ids"])),
            recent_call_ids=OrderedDict.fromkeys(record["recent_call_ids"]),
            inference_tokens=record["inference_tokens"],
            aggregate_tokens=record["aggregate_tokens"],
            fired=set(record["fired"]),
            last_seen=record["last_seen"],
        )

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TraceState:
        return cls.from_dict(json.loads(data))

    def restart_window(self) -> None:
        self.window.clear()
        self.counts.clear()
        self.polls.clear()
        self.poll_counts.clear()


def _call_key(key: list[Any]) -> CallKey:
    tool, digest, *rest = key
    return (tool, digest, rest[0] if rest else None)


def _split_ids(encoded: str) -> list[bytes]:
    raw = base64.b64decode(encoded)
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]
