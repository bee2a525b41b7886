"""What the guard remembers of one trace, and its compact serialised form (the changelog's).

The serialised form is versioned (`v`, STATE_VERSION): a state written by an earlier version
loads (tests/fixtures/state holds one as version 1 wrote it), and keys a version does not know
are ignored, so a worker rolled back still reads what a newer one wrote.
"""

from __future__ import annotations

import base64
import json
import struct
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice
from typing import Any, Final

from mypy_extensions import mypyc_attr

from spanguard.detection.results import EMPTY, EMPTY_RESULT_DIGESTS
from spanguard.detection.rules.base import Fired
from spanguard.schemas import compact_json

__all__ = [
    "MARK_BYTES",
    "STATE_VERSION",
    "CallKey",
    "TraceState",
    "call_mark",
    "encode_record",
    "iso_from_micros",
    "trim_window",
]

# 1: no `v` key; 2: `v`, and `cycle_runs` when a cycle is building; 3: the costs
# (`inference_cost`, `aggregate_cost`, `unpriced_tokens`) once usage was priced, and the
# `conversation_id` of a trace in the conversation scope; 4: `recent_call_ends`, when each
# remembered call id's span ended.
STATE_VERSION = 4

CallKey = tuple[str, str | None, str | None]
# A window entry's span id (8 bytes) and end time (8 bytes, microseconds since the epoch).
MARK_BYTES = 16
_NO_MARK = bytes(MARK_BYTES)


def iso_from_micros(micros: int) -> str:
    """Microseconds since the epoch as ISO 8601 UTC, exactly (no float rounding)."""
    seconds, fraction = divmod(micros, 1_000_000)
    moment = datetime.fromtimestamp(seconds, UTC).replace(microsecond=fraction)
    return moment.isoformat(timespec="microseconds")


_MARK: Final = struct.Struct(">8sQ").pack  # 8s: the span id cut or padded to 8 bytes


def call_mark(span_id: bytes, end_unix_nano: int) -> bytes:
    """What the window remembers of a call besides its key: 16 bytes, cheap to keep."""
    return _MARK(span_id, end_unix_nano // 1000 if end_unix_nano > 0 else 0)


@mypyc_attr(allow_interpreted_subclasses=True)  # the conversation's state extends it
@dataclass(slots=True)
class TraceState:
    """What the guard remembers of one trace: hashes and counts, never raw arguments."""

    service: str = "unknown_service"
    agent_name: str | None = None
    # (tool name, args hash or None, result hash or None) of the last `window` calls.
    window: deque[CallKey] = field(default_factory=deque)
    # Aligned with `window`: each call's call_mark(), 16 bytes a call in one bytearray (a deque
    # of small bytes would cost several times that), so a decision can show the window as it
    # was when it tripped (span ids and times; the keys are in `window`).
    window_marks: bytearray = field(default_factory=bytearray)
    counts: dict[CallKey, int] = field(default_factory=dict)
    # (tool name, args hash) of the last `polling.window` calls whose result was recorded.
    polls: deque[tuple[str, str]] = field(default_factory=deque)
    poll_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    # Oldest first. Plain dicts (a third of an OrderedDict's cost per span), trimmed in bulk by
    # the guard: a dict drops its oldest entries cheaply only many at a time.
    recent_span_ids: dict[bytes, None] = field(default_factory=dict)  # raw ids
    # Call id -> when its counted span ended (microseconds; 0: unknown, as in states written
    # before version 4).
    recent_call_ids: dict[str, int] = field(default_factory=dict)
    inference_tokens: int | None = None
    aggregate_tokens: int = 0
    fired: set[Fired] = field(default_factory=set)  # (rule, action) already decided
    last_seen: float = 0.0
    # When the operator's release last applied to this trace was issued (epoch seconds; 0:
    # none): a release is applied once, and a kill after it stands.
    released_at: float = 0.0
    # The cycle rule's run lengths: [p - 1] = calls in a row equal to the call p before them;
    # None while no call repeats one of the last max_period (most of the time).
    cycle_runs: list[int] | None = None
    # Pico-dollars (1e-12 USD) spent, as priced by spanguard/detection/pricing.py: inference
    # spans' sum (None: none priced yet), agent spans' largest total; and the tokens of
    # inference spans nothing could price (a cost is then a lower bound, never a silent 0).
    inference_cost: int | None = None
    aggregate_cost: int = 0
    unpriced_tokens: int = 0
    # The conversation the trace belongs to (the first id its spans named), when the
    # conversation scope is on.
    conversation_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        record = {
            "v": STATE_VERSION,
            "service": self.service,
            "agent_name": self.agent_name,
            "window": list(self.window),  # tuples: JSON arrays, as lists would be
            "polls": list(self.polls),
            "window_marks": base64.b64encode(self.window_marks).decode(),
            # One base64 string of the 8-byte ids: a third of the size of a list of hex strings,
            # and it is written to the changelog on every update.
            "recent_span_ids": base64.b64encode(b"".join(self.recent_span_ids)).decode(),
            "recent_call_ids": list(self.recent_call_ids),
            "recent_call_ends": list(self.recent_call_ids.values()),  # version 4
            "inference_tokens": self.inference_tokens,
            "aggregate_tokens": self.aggregate_tokens,
            "fired": sorted(map(str, self.fired)),
            "released_at": self.released_at,
        }
        if self.cycle_runs is not None:
            record["cycle_runs"] = self.cycle_runs
        if self.inference_cost is not None or self.aggregate_cost or self.unpriced_tokens:
            record["inference_cost"] = self.inference_cost  # version 3, when usage is priced
            record["aggregate_cost"] = self.aggregate_cost
            record["unpriced_tokens"] = self.unpriced_tokens
        if self.conversation_id is not None:
            record["conversation_id"] = self.conversation_id  # version 3
        # Last, so eviction can read it without decoding (streams/expiry.py).
        record["last_seen"] = self.last_seen
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> TraceState:
        # Records written before results were read hold (tool, args hash) pairs.
        window = deque(_call_key(key) for key in record["window"])
        polls = deque((tool, digest) for tool, digest in record.get("polls", ()))
        marks = bytearray(base64.b64decode(record.get("window_marks", "")))
        # A state written before marks existed: unknown span ids and times for its calls.
        wanted = len(window) * MARK_BYTES
        marks = bytearray(max(wanted - len(marks), 0)) + marks[max(len(marks) - wanted, 0) :]
        return cls(
            service=record["service"],
            agent_name=record["agent_name"],
            window=window,
            window_marks=marks,
            counts=dict(Counter(window)),
            polls=polls,
            poll_counts=dict(Counter(polls)),
            recent_span_ids=dict.fromkeys(_split_ids(record["recent_span_ids"])),
            recent_call_ids=_call_ends(record),
            inference_tokens=record["inference_tokens"],
            aggregate_tokens=record["aggregate_tokens"],
            fired={Fired.parse(text) for text in record["fired"]},
            last_seen=record["last_seen"],
            released_at=record.get("released_at", 0.0),  # states written before releases
            cycle_runs=record.get("cycle_runs"),  # version 2
            inference_cost=record.get("inference_cost"),  # version 3
            aggregate_cost=record.get("aggregate_cost", 0),
            unpriced_tokens=record.get("unpriced_tokens", 0),
            conversation_id=record.get("conversation_id"),
        )

    def to_bytes(self) -> bytes:
        return encode_record(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> TraceState:
        return cls.from_dict(json.loads(data))

    def restart_window(self) -> None:
        self.window.clear()
        self.window_marks.clear()
        self.counts.clear()
        self.polls.clear()
        self.poll_counts.clear()
        self.cycle_runs = None

    def forget_calls_before(self, micros: int) -> None:
        """Drop the window's oldest calls that ended before `micros` (all of them when none
        ended after it): the rules count from there."""
        marks = self.window_marks
        keep_from = 0
        for start in range(0, len(marks), MARK_BYTES):
            ended = int.from_bytes(marks[start + 8 : start + MARK_BYTES], "big")
            if ended and ended >= micros:
                break
            keep_from += 1
        if keep_from >= len(self.window):
            self.restart_window()
            return
        if not keep_from:
            return
        trim_window(self.window, self.counts, marks, len(self.window) - keep_from)
        self.cycle_runs = None

    def window_calls(self, last: int | None = None) -> list[dict[str, Any]]:
        """The window (or its `last` calls), oldest first: tool name, args hash, span id and
        end time of each call."""
        calls = []
        marks = self.window_marks
        skip = 0 if last is None else max(len(self.window) - last, 0)
        starts = range(skip * MARK_BYTES, len(marks), MARK_BYTES)
        keys = islice(self.window, skip, None)
        for (tool_name, digest, _result), start in zip(keys, starts, strict=True):
            mark = marks[start : start + MARK_BYTES]
            micros = int.from_bytes(mark[8:], "big")
            calls.append(
                {
                    "tool_name": tool_name,
                    "args_hash": digest,
                    "span_id": mark[:8].hex() if mark[:8] != _NO_MARK[:8] else None,
                    "ended_at": iso_from_micros(micros) if micros else None,
                }
            )
        return calls


def trim_window(window: Any, counts: dict[Any, int], marks: bytearray, size: int) -> None:
    """Drop the oldest calls of a window grown past `size`, with their counts and the marks
    aligned with it."""
    while len(window) > size:
        oldest = window.popleft()
        del marks[:MARK_BYTES]
        remaining = counts[oldest] - 1
        if remaining:
            counts[oldest] = remaining
        else:
            del counts[oldest]


def encode_record(record: dict[str, Any]) -> bytes:
    """A state's record as compact JSON (schemas/compact_json.py: orjson's where installed,
    json's for what orjson refuses and without it). Both read back alike."""
    return compact_json.dumps(record)


def _call_key(key: Sequence[Any]) -> CallKey:
    """A window entry as read back: a list from JSON, a tuple from `to_dict` itself. An empty
    result a version before 4 hashed is read as the marker version 4 keys it by."""
    tool, digest, *rest = key
    result = rest[0] if rest else None
    if result in EMPTY_RESULT_DIGESTS:
        result = EMPTY
    return (tool, digest, result)


def _call_ends(record: dict[str, Any]) -> dict[str, int]:
    """Call ids and their spans' end times; 0 for states written before version 4."""
    ids = record["recent_call_ids"]
    ends = record.get("recent_call_ends")
    if not isinstance(ends, list) or len(ends) != len(ids):
        return dict.fromkeys(ids, 0)
    return dict(zip(ids, ends, strict=True))


def _split_ids(encoded: str) -> list[bytes]:
    raw = base64.b64decode(encoded)
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]
