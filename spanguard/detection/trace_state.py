"""What the guard remembers of one trace, and its compact serialised form (the changelog's).

The serialised form is versioned (STATE_VERSION): from version 5 a binary record
(`encode_state`: hashes as raw bytes, times as offsets from a base, tool names written once),
before it compact JSON with a `v` key. A state written by an earlier version loads
(tests/fixtures/state holds one of version 1 and one of version 4). What a later version adds
is ignored: JSON keys it does not know, binary sections after the ones it reads. Bytes that are
no state raise StateDecodeError, with the reason.
"""

from __future__ import annotations

import base64
import json
import struct
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from hashlib import blake2b
from typing import Any, Final

from mypy_extensions import mypyc_attr

from spanguard.detection.agent_tree import AgentTree
from spanguard.detection.results import EMPTY, EMPTY_RESULT_DIGESTS
from spanguard.detection.rules.base import Fired
from spanguard.schemas import compact_json

__all__ = [
    "MARK_BYTES",
    "STATE_VERSION",
    "CallKey",
    "CallWindow",
    "RecentCalls",
    "RecentIds",
    "StateDecodeError",
    "TraceState",
    "call_id_key",
    "call_mark",
    "encode_record",
    "iso_from_micros",
    "shared_text",
    "stored_state_last_seen",
    "trim_window",
]

# 1: no `v` key; 2: `v`, and `cycle_runs` when a cycle is building; 3: the costs
# (`inference_cost`, `aggregate_cost`, `unpriced_tokens`) once usage was priced, and the
# `conversation_id` of a trace in the conversation scope; 4: `recent_call_ends`, when each
# remembered call id's span ended; 5: binary (`encode_state`), the JSON record kept for the
# conversation's state and what the binary form cannot hold; call ids as their `call_id_key`;
# 6: the trace's agent tree (`agent_tree`), when it has one: a trailing binary section (its tag,
# then its JSON record), a JSON key.
STATE_VERSION = 6

CallKey = tuple[str, str | None, str | None]
# A window entry's span id (8 bytes) and end time (8 bytes, microseconds since the epoch).
MARK_BYTES = 16
_NO_MARK = bytes(MARK_BYTES)


def iso_from_micros(micros: int) -> str:
    """Microseconds since the epoch as ISO 8601 UTC, exactly (no float rounding)."""
    seconds, fraction = divmod(micros, 1_000_000)
    moment = datetime.fromtimestamp(seconds, UTC).replace(microsecond=fraction)
    return moment.isoformat(timespec="microseconds")


# The tag of the binary state's trailing agent-tree section (its JSON record follows).
_AGENT_TREE_SECTION: Final = 0x41
_MARK: Final = struct.Struct(">8sQ").pack  # 8s: the span id cut or padded to 8 bytes


def call_mark(span_id: bytes, end_unix_nano: int) -> bytes:
    """What the window remembers of a call besides its key: 16 bytes, cheap to keep."""
    return _MARK(span_id, end_unix_nano // 1000 if end_unix_nano > 0 else 0)


# -- compact containers ------------------------------------------------------------------------
#
# A trace's state is kept for every active trace: its recent ids and its window live in bytes
# objects of fixed-width entries (a dict or a deque of tuples and strings costs several times
# as much), searched with bytes.find and counted where an entry starts.

_ID_BYTES: Final = 8
_CALL_ENTRY_BYTES: Final = 16  # a call id's key, then when its call ended (signed microseconds)
# A window entry: the result hash, the tool's place in `texts`, the args hash; a hash as a form
# byte and 8 bytes (the raw hash, or the text's place in `texts`).
_TOOL_BYTES: Final = 4
_HASH_BYTES: Final = 9
_CALL_WIDTH: Final = _TOOL_BYTES + 2 * _HASH_BYTES
_POLL_WIDTH: Final = _TOOL_BYTES + _HASH_BYTES
_NO_HASH: Final = bytes(_HASH_BYTES)
_HEX_FORM: Final = b"\x01"
_TEXT_FORM: Final = b"\x02"


def _entry_at(data: bytes, entry: bytes, width: int, start: int = 0) -> int:
    """Where `entry` starts an entry of `data` (entries of `width` bytes), from `start`; -1
    when none does. A match across two entries is skipped."""
    at = data.find(entry, start)
    while at >= 0 and at % width:
        at = data.find(entry, at + 1)
    return at


# Tool and service names (and the odd hash that is no hex) as one string object for every trace
# that names them: each span brings its own copy. Bounded: names past it are kept per trace.
_SHARED_TEXTS: Final[dict[str, str]] = {}
_MAX_SHARED_TEXTS: Final = 4096


def shared_text(text: str) -> str:
    """`text` as the one object every trace naming it holds (up to a bound)."""
    shared = _SHARED_TEXTS.get(text)
    if shared is not None:
        return shared
    if len(_SHARED_TEXTS) < _MAX_SHARED_TEXTS:
        _SHARED_TEXTS[text] = text
    return text


def _hex_digest_bytes(digest: str) -> bytes | None:
    """The 8 bytes of a digest written as 16 lowercase hex digits (ours), which they give back
    exactly; None for any other text, kept as text."""
    if len(digest) != 16:
        return None
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        return None
    return raw if len(raw) == 8 and raw.hex() == digest else None


def _as_id(raw: bytes) -> bytes:
    """An id as 8 bytes: span ids are; anything else is kept as 8 bytes of its digest."""
    if len(raw) == _ID_BYTES:
        return raw
    return blake2b(raw, digest_size=_ID_BYTES).digest()


@dataclass(slots=True)
class RecentIds:
    """Span ids, oldest first, 8 bytes each in one bytes object."""

    data: bytes = b""

    @classmethod
    def of(cls, ids: Iterable[bytes]) -> RecentIds:
        return cls(b"".join(map(_as_id, ids)))

    def __contains__(self, span_id: object) -> bool:
        if not isinstance(span_id, bytes):
            return False
        if len(span_id) != _ID_BYTES:
            span_id = _as_id(span_id)
        data = self.data
        at = data.find(span_id)
        while at >= 0 and at % _ID_BYTES:  # across two ids: neither
            at = data.find(span_id, at + 1)
        return at >= 0

    def __len__(self) -> int:
        return len(self.data) // _ID_BYTES

    def __iter__(self) -> Iterator[bytes]:
        data = self.data
        return (data[at : at + _ID_BYTES] for at in range(0, len(data), _ID_BYTES))

    def seen(self, span_id: bytes, keep: int) -> bool:
        """Whether `span_id` is among the ids; if not, it is added as by `add` (one call: this
        runs on every span)."""
        if len(span_id) != _ID_BYTES:
            span_id = _as_id(span_id)
        data = self.data
        if _entry_at(data, span_id, _ID_BYTES) >= 0:
            return True
        data += span_id
        if len(data) > (keep + (keep >> 2)) * _ID_BYTES:
            data = data[len(data) - keep * _ID_BYTES :]
        self.data = data
        return False

    def add(self, span_id: bytes, keep: int, slack: int = -1) -> None:
        """Remember `span_id`; past `keep` and `slack` more (a quarter of `keep` unless given),
        only the newest `keep` are kept: trimmed in bulk, a copy each time costs more."""
        data = self.data + (span_id if len(span_id) == _ID_BYTES else _as_id(span_id))
        if len(data) > (keep + (keep >> 2 if slack < 0 else slack)) * _ID_BYTES:
            data = data[len(data) - keep * _ID_BYTES :]
        self.data = data


@dataclass(slots=True)
class RecentCalls:
    """Call ids' keys (call_id_key) and when their counted spans ended (microseconds; 0:
    unknown), oldest first, 16 bytes each in one bytes object."""

    data: bytes = b""

    @classmethod
    def of(cls, ends: Iterable[tuple[bytes, int]]) -> RecentCalls:
        calls = cls()
        for key, micros in ends:
            calls.remove(key)
            calls.add(key, micros)
        return calls

    def __len__(self) -> int:
        return len(self.data) // _CALL_ENTRY_BYTES

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.get(key) is not None

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.keys())

    def keys(self) -> list[bytes]:
        data = self.data
        return [data[at : at + _ID_BYTES] for at in range(0, len(data), _CALL_ENTRY_BYTES)]

    def values(self) -> list[int]:
        data = self.data
        return [
            int.from_bytes(data[at + _ID_BYTES : at + _CALL_ENTRY_BYTES], "big", signed=True)
            for at in range(0, len(data), _CALL_ENTRY_BYTES)
        ]

    def items(self) -> list[tuple[bytes, int]]:
        return list(zip(self.keys(), self.values(), strict=True))

    def get(self, key: bytes) -> int | None:
        data = self.data
        if len(key) != _ID_BYTES:
            key = _as_id(key)
        at = _entry_at(data, key, _CALL_ENTRY_BYTES)
        if at < 0:
            return None
        return int.from_bytes(data[at + _ID_BYTES : at + _CALL_ENTRY_BYTES], "big", signed=True)

    def note(self, key: bytes, micros: int, keep: int) -> int | None:
        """When `key`'s call ended, left as it is, if it is among them; else None, and it is
        added as by `add` (one search for both: this runs on every call with an id)."""
        if len(key) != _ID_BYTES:
            key = _as_id(key)
        data = self.data
        at = _entry_at(data, key, _CALL_ENTRY_BYTES)
        if at >= 0:
            return int.from_bytes(data[at + _ID_BYTES : at + _CALL_ENTRY_BYTES], "big", signed=True)
        data += key + micros.to_bytes(8, "big", signed=True)
        if len(data) > (keep + (keep >> 2)) * _CALL_ENTRY_BYTES:
            data = data[len(data) - keep * _CALL_ENTRY_BYTES :]
        self.data = data
        return None

    def remove(self, key: bytes) -> None:
        data = self.data
        at = _entry_at(data, _as_id(key), _CALL_ENTRY_BYTES)
        if at >= 0:
            self.data = data[:at] + data[at + _CALL_ENTRY_BYTES :]

    def add(self, key: bytes, micros: int, keep: int = 0) -> None:
        """Remember `key`, not among them, as the newest with when its call ended; with
        `keep`, past `keep` and a quarter only the newest `keep` are kept (in bulk)."""
        if len(key) != _ID_BYTES:
            key = _as_id(key)
        data = self.data + key + micros.to_bytes(8, "big", signed=True)
        if keep and len(data) > (keep + (keep >> 2)) * _CALL_ENTRY_BYTES:
            data = data[len(data) - keep * _CALL_ENTRY_BYTES :]
        self.data = data


@dataclass(slots=True, eq=False)
class CallWindow:
    """The keys of a trace's last calls, oldest first: (tool, args hash, result hash) tuples,
    or (tool, args hash) pairs in a poll window (`width` _POLL_WIDTH).

    Kept as fixed-width entries in one bytes object: the result hash (none in a poll window),
    the tool's place in `texts` (4 bytes), the args hash; a hash as a form byte and 8 bytes:
    its raw bytes when it is 16 lowercase hex digits (nearly always), else its text's place in
    `texts`. Iterating gives the keys back;
    the rules count and compare entries without building them (`count`, `matches_back`)."""

    width: int = _CALL_WIDTH
    entries: bytes = b""
    texts: tuple[str, ...] = ()  # tool names and hashes that are not 16 hex digits
    # The last key packed, its entry, and how many calls of `entries` (when it was counted
    # in this very object) have it: a call's key is packed and counted once for every rule,
    # and kept counted as the call joins the window. The guard drops it once the rules ran.
    memo: tuple[Any, bytes, bytes | None, int] | None = None

    @classmethod
    def of(cls, keys: Iterable[Sequence[Any]], width: int = _CALL_WIDTH) -> CallWindow:
        window = cls(width)
        for key in keys:
            window.append(tuple(key))
        window.memo = None
        return window

    def __len__(self) -> int:
        return len(self.entries) // self.width

    def __iter__(self) -> Iterator[Any]:
        return iter(self.last(len(self)))

    def __reversed__(self) -> Iterator[Any]:
        return iter(self.newest_first(len(self)))

    def __getitem__(self, index: int) -> Any:
        size = len(self)
        place = index + size if index < 0 else index
        if not 0 <= place < size:
            raise IndexError("window index out of range")
        return self._key(place * self.width)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CallWindow):
            return NotImplemented
        return self.width == other.width and list(self) == list(other)

    def __repr__(self) -> str:
        return f"CallWindow({list(self)!r})"

    def append(self, key: Any) -> None:
        self.push(key, -1)

    def push(self, key: Any, keep: int) -> None:
        """Append `key`; the oldest calls past `keep` (unless negative) are dropped (one call:
        the guard makes it for every call)."""
        memo = self.memo
        if memo is not None and memo[0] is key:
            entry = memo[1]  # packed by a rule that counted it
        else:
            if len(self.texts) > 3 * len(self.entries) // self.width + 16:
                self._compact()
            entry = self._entry(key, True)  # type: ignore[assignment]
            memo = self.memo
        before, width = self.entries, self.width
        joined = entries = before + entry
        cut = len(joined) - keep * width if keep >= 0 else 0
        if cut > 0:
            entries = joined[cut:]
        self.entries = entries
        if memo is not None and memo[0] is key and memo[2] is before:
            found = memo[3] + 1
            for at in range(0, cut, width):  # the dropped calls that had it
                if joined.startswith(entry, at):
                    found -= 1
            self.memo = (key, entry, entries, found)

    def extend(self, keys: Iterable[Any]) -> None:
        for key in keys:
            self.append(key)

    def clear(self) -> None:
        self.entries = b""
        self.texts = ()
        self.memo = None

    def drop_oldest(self, calls: int) -> None:
        if calls <= 0:
            return
        before, cut, width = self.entries, calls * self.width, self.width
        entries = self.entries = before[cut:]
        memo = self.memo
        if memo is not None and memo[2] is before:
            entry = memo[1]
            dropped = 0
            for at in range(0, cut, width):
                if before.startswith(entry, at):
                    dropped += 1
            self.memo = (memo[0], entry, entries, memo[3] - dropped)

    def count(self, key: Any) -> int:
        """How many calls of the window have `key`."""
        memo, entries = self.memo, self.entries
        if memo is not None and memo[0] is key and memo[2] is entries:
            return memo[3]
        entry = self._entry(key, False)
        if entry is None:
            return 0
        width = self.width
        found = 0
        at = entries.find(entry)
        while at >= 0:
            if at % width:  # across two entries: no call's
                at = entries.find(entry, at + 1)
                continue
            found += 1
            at = entries.find(entry, at + width)
        if width == _CALL_WIDTH:
            self.memo = (key, entry, entries, found)
        return found

    def count_recent(self, key: Any, last: int) -> int:
        """How many of the window's last `last` calls have `key`."""
        if last >= len(self):
            return self.count(key)
        recent = CallWindow(self.width, self.entries[-last * self.width :], self.texts, self.memo)
        return recent.count(key)

    def __contains__(self, key: object) -> bool:
        return self.count(key) > 0

    def matches_back(self, key: Any, calls: int, whole: bool = True) -> list[bool]:
        """For the window's last `calls` calls, newest first: whether each has `key` (`whole`),
        or its tool and arguments."""
        memo = self.memo
        entry = memo[1] if memo is not None and memo[0] is key else self._entry(key, False)
        width = self.width
        calls = min(calls, len(self.entries) // width)
        if entry is None:
            return [False] * calls
        # The tool and arguments are an entry's last bytes (after the result's).
        skip = 0 if whole else width - _TOOL_BYTES - _HASH_BYTES
        probe = entry[skip:]
        entries, end = self.entries, len(self.entries) + skip
        return [entries.startswith(probe, end - back * width) for back in range(1, calls + 1)]

    def last(self, calls: int) -> list[Any]:
        """The window's last `calls` keys, oldest first."""
        width = self.width
        start = max(len(self.entries) - calls * width, 0)
        return [self._key(at) for at in range(start, len(self.entries), width)]

    def newest_first(self, calls: int) -> list[Any]:
        """The window's last `calls` keys, newest first."""
        keys = self.last(calls)
        keys.reverse()
        return keys

    def _entry(self, key: Any, add: bool) -> bytes | None:
        """`key`'s entry; None when it cannot be in the window (a text the window has not), or,
        with `add`, the texts it needs added."""
        memo = self.memo
        if memo is not None and memo[0] is key:
            return memo[1]
        texts = self.texts
        tool = key[0]
        try:
            index = texts.index(tool)
        except ValueError:
            if not add:
                return None
            index = self._add_text(tool)
        poll = self.width == _POLL_WIDTH
        # The result's part first, the arguments' last: bytes.find checks a needle's last
        # byte first, and a hash's is nearly never the same.
        entry = b"" if poll else self._hash_part(key[2], add)
        if entry is None:
            return None
        args = self._hash_part(key[1], add)
        if args is None:
            return None
        entry += index.to_bytes(_TOOL_BYTES, "big") + args
        if not poll:  # a poll's key is made anew for each use: no memo
            self.memo = (key, entry, None, 0)
        return entry

    def _hash_part(self, digest: str | None, add: bool) -> bytes | None:
        if digest is None:
            return _NO_HASH
        raw = _hex_digest_bytes(digest)
        if raw is not None:
            return _HEX_FORM + raw
        return self._text_part(digest, add)

    def _text_part(self, text: str, add: bool) -> bytes | None:
        texts = self.texts
        if text in texts:
            index = texts.index(text)
        elif add:
            index = self._add_text(text)
        else:
            return None
        return _TEXT_FORM + index.to_bytes(_HASH_BYTES - 1, "big")

    def _add_text(self, text: str) -> int:
        self.texts = (*self.texts, shared_text(text))
        return len(self.texts) - 1

    def _compact(self) -> None:
        """Texts the window's calls no longer name are dropped (their places change)."""
        keys = list(self)
        self.clear()
        for key in keys:
            self.entries += self._entry(key, True)  # type: ignore[operator]

    def _key(self, at: int) -> Any:
        entries = self.entries
        if self.width == _POLL_WIDTH:
            tool = self.texts[int.from_bytes(entries[at : at + _TOOL_BYTES], "big")]
            return (tool, self._hash_at(at + _TOOL_BYTES))
        result = self._hash_at(at)
        at += _HASH_BYTES
        tool = self.texts[int.from_bytes(entries[at : at + _TOOL_BYTES], "big")]
        return (tool, self._hash_at(at + _TOOL_BYTES), result)

    def _hash_at(self, at: int) -> str | None:
        entries = self.entries
        form = entries[at]
        if not form:
            return None
        payload = entries[at + 1 : at + _HASH_BYTES]
        if form == _HEX_FORM[0]:
            return payload.hex()
        return self.texts[int.from_bytes(payload, "big")]


def _poll_window() -> CallWindow:
    return CallWindow(_POLL_WIDTH)


@mypyc_attr(allow_interpreted_subclasses=True)  # the conversation's state extends it
@dataclass(slots=True)
class TraceState:
    """What the guard remembers of one trace: hashes and counts, never raw arguments."""

    service: str = "unknown_service"
    agent_name: str | None = None
    # (tool name, args hash or None, result hash or None) of the last `window` calls; the
    # rules count them there (`CallWindow.count`).
    window: CallWindow = field(default_factory=CallWindow)
    # Aligned with `window`: each call's call_mark(), 16 bytes a call in one bytes object (a deque
    # of small bytes would cost several times that), so a decision can show the window as it
    # was when it tripped (span ids and times; the keys are in `window`).
    window_marks: bytes = b""
    # (tool name, args hash) of the last `polling.window` calls whose result was recorded.
    polls: CallWindow = field(default_factory=_poll_window)
    # Oldest first, trimmed in bulk by the guard.
    recent_span_ids: RecentIds = field(default_factory=RecentIds)  # raw ids
    # Call id (its call_id_key) -> when its counted span ended (microseconds; 0: unknown, as in
    # states written before version 4).
    recent_call_ids: RecentCalls = field(default_factory=RecentCalls)
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
    # The trace's agents (spanguard/detection/agent_tree.py): None until its first agent span
    # or handoff, so a single-agent trace costs nothing more.
    agent_tree: AgentTree | None = None

    @property
    def counts(self) -> dict[CallKey, int]:
        """How many times each call of the window was made (the rules count its entries)."""
        return dict(Counter(self.window))

    @property
    def poll_counts(self) -> dict[tuple[str, str], int]:
        """How many times each poll of `polls` was made."""
        return dict(Counter(self.polls))

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
            "recent_span_ids": base64.b64encode(self.recent_span_ids.data).decode(),
            # Hex keys from version 5: an earlier version reads them as ids no call has.
            "recent_call_ids": [key.hex() for key in self.recent_call_ids],
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
        if self.agent_tree is not None:
            record["agent_tree"] = self.agent_tree.to_record()
        # Last, so eviction can read it without decoding (streams/expiry.py).
        record["last_seen"] = self.last_seen
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> TraceState:
        # Records written before results were read hold (tool, args hash) pairs.
        window = CallWindow.of(_call_key(key) for key in record["window"])
        polls = CallWindow.of(
            ((tool, digest) for tool, digest in record.get("polls", ())), _POLL_WIDTH
        )
        marks = _aligned(base64.b64decode(record.get("window_marks", "")), len(window))
        return cls(
            service=record["service"],
            agent_name=record["agent_name"],
            window=window,
            window_marks=marks,
            polls=polls,
            recent_span_ids=RecentIds.of(_split_ids(record["recent_span_ids"])),
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
            agent_tree=(
                AgentTree.from_record(record["agent_tree"]) if "agent_tree" in record else None
            ),
        )

    def to_bytes(self) -> bytes:
        # A subclass (the conversation's state) has fields of its own: its JSON record has them.
        if type(self) is TraceState:
            try:
                return encode_state(self)
            # Also a field of another type than declared (a service None, read from a JSON
            # record): JSON holds any, and reads back as it was.
            except (_NotBinary, AttributeError, TypeError):
                pass
        return encode_record(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> TraceState:
        """The state `data` holds, binary or JSON; StateDecodeError when it holds none."""
        if not data:
            raise StateDecodeError("empty")
        try:
            if data[:1] == _BINARY_MARK:
                return _decode_state(cls, data)
            record = json.loads(data)
            if not isinstance(record, dict):
                raise StateDecodeError(f"JSON {type(record).__name__}, not a state record")
            return cls.from_dict(record)
        except StateDecodeError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError) as exc:
            raise StateDecodeError(f"{type(exc).__name__}: {exc}") from exc

    def restart_window(self) -> None:
        self.window.clear()
        self.window_marks = b""
        self.polls.clear()
        self.cycle_runs = None
        if self.agent_tree is not None:
            self.agent_tree.handoffs.clear()

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
        trim_window(self, len(self.window) - keep_from)
        self.cycle_runs = None

    def window_entries(self, last: int | None = None) -> list[tuple[CallKey, bytes, int]]:
        """The window's calls (or its `last`), oldest first: each call's key, span id (cut to 8
        bytes) and end time (nanoseconds, to the microsecond kept; 0: none)."""
        marks = self.window_marks
        skip = 0 if last is None else max(len(self.window) - last, 0)
        starts = range(skip * MARK_BYTES, len(marks), MARK_BYTES)
        keys = self.window.last(len(self.window) - skip)
        return [
            (
                key,
                marks[start : start + 8],
                int.from_bytes(marks[start + 8 : start + 16], "big") * 1000,
            )
            for key, start in zip(keys, starts, strict=True)
        ]

    def window_calls(self, last: int | None = None) -> list[dict[str, Any]]:
        """The window (or its `last` calls), oldest first: tool name, args hash, span id and
        end time of each call."""
        return [
            {
                "tool_name": tool_name,
                "args_hash": digest,
                "span_id": span_id.hex() if span_id != _NO_MARK[:8] else None,
                "ended_at": iso_from_micros(ended // 1000) if ended else None,
            }
            for (tool_name, digest, _result), span_id, ended in self.window_entries(last)
        ]


def trim_window(state: TraceState, size: int) -> None:
    """Drop the oldest calls of a state's window grown past `size`, with the marks aligned
    with it."""
    excess = len(state.window) - size
    if excess > 0:
        state.window.drop_oldest(excess)
        state.window_marks = state.window_marks[excess * MARK_BYTES :]


def encode_record(record: dict[str, Any]) -> bytes:
    """A state's record as compact JSON (schemas/compact_json.py: orjson's where installed,
    json's for what orjson refuses and without it). Both read back alike."""
    return compact_json.dumps(record)


def _aligned(marks: bytes, calls: int) -> bytes:
    """`marks` for a window of `calls` calls: a state written before marks existed (or one
    built without them) has unknown span ids and times for its calls."""
    wanted = calls * MARK_BYTES
    if len(marks) == wanted:
        return marks
    return bytes(max(wanted - len(marks), 0)) + marks[max(len(marks) - wanted, 0) :]


def _call_key(key: Sequence[Any]) -> CallKey:
    """A window entry as read back: a list from JSON, a tuple from `to_dict` itself. An empty
    result a version before 4 hashed is read as the marker version 4 keys it by."""
    tool, digest, *rest = key
    result = rest[0] if rest else None
    if result in EMPTY_RESULT_DIGESTS:
        result = EMPTY
    return (tool, digest, result)


def call_id_key(call_id: str) -> bytes:
    """A call id as a state remembers it: 8 bytes of its BLAKE2b digest, whatever its length
    (providers' ids run to 30 characters). Two of a trace's last few dozen ids sharing a key is
    a chance of about one in 10^16."""
    return blake2b(call_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def _call_ends(record: dict[str, Any]) -> RecentCalls:
    """Call ids' keys and their spans' end times; 0 for states written before version 4. Until
    version 5 the record held the ids themselves."""
    if record.get("v", 1) >= 5:
        ids = [bytes.fromhex(key) for key in record["recent_call_ids"]]
    else:
        ids = [call_id_key(call_id) for call_id in record["recent_call_ids"]]
    ends = record.get("recent_call_ends")
    if not isinstance(ends, list) or len(ends) != len(ids):
        return RecentCalls.of((key, 0) for key in ids)
    return RecentCalls.of(zip(ids, ends, strict=True))


def _split_ids(encoded: str) -> list[bytes]:
    raw = base64.b64decode(encoded)
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]


# -- the binary form (version 5) --------------------------------------------------------------
#
# A marker byte (JSON's first is "{"), the version, last_seen (fixed offset: eviction reads it
# without decoding), then the fields in order. Counts and lengths are LEB128 varints, other
# ints zigzag varints (any size: a cost may pass 64 bits), times offsets from one base.


class StateDecodeError(ValueError):
    """Stored bytes that are no state (truncated, garbage): the message says why."""


class _NotBinary(Exception):
    """A state the binary form cannot hold (its JSON record is written instead)."""


_BINARY_MARK: Final = b"\x00"
_HEADER: Final = struct.Struct("<cBd")  # marker, version, last_seen
_FLOAT: Final = struct.Struct("<d")
_HEADER_BYTES: Final = _HEADER.size
_MAX_VARINT_BYTES: Final = 20
# Flags: which optional fields follow.
_AGENT_NAME: Final = 1
_RELEASED: Final = 2
_INFERENCE_TOKENS: Final = 4
_PRICED: Final = 8
_CONVERSATION: Final = 16
_CYCLE_RUNS: Final = 32
# A digest's form: absent, 16 lowercase hex digits (8 bytes), other text.
_NO_DIGEST: Final = 0
_HEX_DIGEST: Final = 1
_TEXT_DIGEST: Final = 2


def stored_state_last_seen(data: bytes) -> float | None:
    """last_seen of a binary state, read off its header (None: not a binary state)."""
    if len(data) < _HEADER_BYTES or data[:1] != _BINARY_MARK:
        return None
    last_seen: float = _HEADER.unpack_from(data)[2]
    return last_seen


def _put_uint(out: bytearray, value: int) -> None:
    if 0 <= value < 0x80:  # most: one byte
        out.append(value)
        return
    if value < 0:
        raise _NotBinary("a negative count")
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_int(out: bytearray, value: int) -> None:
    _put_uint(out, value << 1 if value >= 0 else ((-value) << 1) - 1)


def _put_text(out: bytearray, text: str) -> None:
    raw = text.encode("utf-8", "surrogatepass")
    _put_uint(out, len(raw))
    out += raw


def _digest_form(digest: str | None) -> tuple[int, bytes]:
    if digest is None:
        return _NO_DIGEST, b""
    raw = _hex_digest_bytes(digest)
    if raw is not None:
        return _HEX_DIGEST, raw
    return _TEXT_DIGEST, digest.encode("utf-8", "surrogatepass")


def _put_digest_payload(out: bytearray, form: int, raw: bytes) -> None:
    if form == _TEXT_DIGEST:
        _put_uint(out, len(raw))
    out += raw


def _put_time(out: bytearray, micros: int, previous: int) -> int:
    """0 (unknown) as 0, any other time as 1 + its zigzag offset from the `previous` known one
    (calls end close to the call before): the time to count the next one from."""
    if not micros:
        out.append(0)
        return previous
    offset = micros - previous
    _put_uint(out, (offset << 1 if offset >= 0 else ((-offset) << 1) - 1) + 1)
    return micros


def _time_base(marks: bytes, ends: RecentCalls) -> int:
    for start in range(len(marks) - MARK_BYTES, -1, -MARK_BYTES):
        micros = int.from_bytes(marks[start + 8 : start + MARK_BYTES], "big")
        if micros:
            return micros
    for micros in ends.values():
        if micros:
            return micros
    return 0


def encode_state(state: TraceState) -> bytes:
    """The binary record of a TraceState (version 5); _NotBinary when it cannot hold it."""
    out = bytearray(_HEADER.pack(_BINARY_MARK, STATE_VERSION, state.last_seen))
    _put_scalars(out, state)
    tools: dict[str, int] = {}
    for key in state.window:
        tools.setdefault(key[0], len(tools))
    for poll in state.polls:
        tools.setdefault(poll[0], len(tools))
    _put_uint(out, len(tools))
    for tool in tools:
        _put_text(out, tool)
    _put_uint(out, len(state.window))
    for tool, args, result in state.window:
        _put_uint(out, tools[tool])
        args_form, args_raw = _digest_form(args)
        result_form, result_raw = _digest_form(result)
        out.append(args_form | result_form << 2)
        _put_digest_payload(out, args_form, args_raw)
        _put_digest_payload(out, result_form, result_raw)
    _put_uint(out, len(state.polls))
    for tool, args in state.polls:
        _put_uint(out, tools[tool])
        args_form, args_raw = _digest_form(args)
        out.append(args_form)
        _put_digest_payload(out, args_form, args_raw)
    _put_calls(out, state)
    if state.agent_tree is not None:
        # An optional trailing section: a state without it ends here.
        out.append(_AGENT_TREE_SECTION)
        _put_text(out, json.dumps(state.agent_tree.to_record(), separators=(",", ":")))
    return bytes(out)


def _put_scalars(out: bytearray, state: TraceState) -> None:
    priced = bool(state.inference_cost is not None or state.aggregate_cost or state.unpriced_tokens)
    flags = (
        (_AGENT_NAME if state.agent_name is not None else 0)
        | (_RELEASED if state.released_at else 0)
        | (_INFERENCE_TOKENS if state.inference_tokens is not None else 0)
        | (_PRICED if priced else 0)
        | (_CONVERSATION if state.conversation_id is not None else 0)
        | (_CYCLE_RUNS if state.cycle_runs is not None else 0)
    )
    out.append(flags)
    _put_text(out, state.service)
    if state.agent_name is not None:
        _put_text(out, state.agent_name)
    if state.released_at:
        out += _FLOAT.pack(state.released_at)
    _put_int(out, state.aggregate_tokens)
    if state.inference_tokens is not None:
        _put_int(out, state.inference_tokens)
    if priced:
        out.append(0 if state.inference_cost is None else 1)
        _put_int(out, state.inference_cost or 0)
        _put_int(out, state.aggregate_cost)
        _put_int(out, state.unpriced_tokens)
    if state.conversation_id is not None:
        _put_text(out, state.conversation_id)
    fired = sorted(map(str, state.fired))
    _put_uint(out, len(fired))
    for text in fired:
        _put_text(out, text)
    if state.cycle_runs is not None:
        _put_uint(out, len(state.cycle_runs))
        for run in state.cycle_runs:
            _put_uint(out, run)


def _put_calls(out: bytearray, state: TraceState) -> None:
    """The recent span ids (raw), the window's marks (a span id as its place among those, times
    as offsets from the time before) and the recent call ids' keys (raw) with when their calls
    ended."""
    marks = state.window_marks
    ends = state.recent_call_ids
    if len(marks) % MARK_BYTES:
        raise _NotBinary("window marks not whole")
    span_ids = state.recent_span_ids
    _put_uint(out, len(span_ids))
    out += span_ids.data
    place = {span_id: at for at, span_id in enumerate(span_ids, 1)}
    base = _time_base(marks, ends)
    _put_uint(out, base)
    _put_uint(out, len(marks) // MARK_BYTES)
    previous = base
    for start in range(0, len(marks), MARK_BYTES):
        span_id = bytes(marks[start : start + 8])
        at = place.get(span_id, 0)  # 0: not among them, its 8 bytes follow
        _put_uint(out, at)
        if not at:
            out += span_id
        previous = _put_time(
            out, int.from_bytes(marks[start + 8 : start + MARK_BYTES], "big"), previous
        )
    _put_uint(out, len(ends))
    out += b"".join(ends.keys())
    previous = base
    for micros in ends.values():
        previous = _put_time(out, micros, previous)


class _Reader:
    """Reads a binary state front to back; StateDecodeError past its end."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = _HEADER_BYTES

    def raw(self, size: int) -> bytes:
        end = self.at + size
        if end > len(self.data):
            raise StateDecodeError(
                f"truncated: {size} bytes wanted at {self.at} of {len(self.data)}"
            )
        chunk = self.data[self.at : end]
        self.at = end
        return chunk

    def byte(self) -> int:
        if self.at >= len(self.data):
            raise StateDecodeError(f"truncated at byte {self.at}")
        value = self.data[self.at]
        self.at += 1
        return value

    def uint(self) -> int:
        data, at = self.data, self.at
        end = min(len(data), at + _MAX_VARINT_BYTES)
        value = shift = 0
        while at < end:
            part = data[at]
            at += 1
            if part < 0x80:
                self.at = at
                return value | part << shift
            value |= (part & 0x7F) << shift
            shift += 7
        if at >= len(data):
            raise StateDecodeError(f"truncated in a number at {self.at}")
        raise StateDecodeError(f"a number longer than {_MAX_VARINT_BYTES} bytes at {self.at}")

    def signed(self) -> int:
        value = self.uint()
        return -((value + 1) >> 1) if value & 1 else value >> 1

    def count(self) -> int:
        """A number of items that follow, each at least a byte: no more than the bytes left."""
        value = self.uint()
        if value > len(self.data) - self.at:
            raise StateDecodeError(
                f"{value} items announced with {len(self.data) - self.at} bytes left"
            )
        return value

    def text(self) -> str:
        return self.raw(self.count()).decode("utf-8", "surrogatepass")

    def digest(self, form: int) -> str | None:
        if form == _NO_DIGEST:
            return None
        if form == _HEX_DIGEST:
            return self.raw(8).hex()
        if form == _TEXT_DIGEST:
            return self.text()
        raise StateDecodeError(f"unknown digest form {form} at {self.at}")

    def time(self, previous: int) -> int:
        """A time written by _put_time after `previous` (0: unknown)."""
        value = self.uint()
        if not value:
            return 0
        value -= 1
        return previous + (-((value + 1) >> 1) if value & 1 else value >> 1)

    def tool(self, tools: list[str]) -> str:
        index = self.uint()
        if index >= len(tools):
            raise StateDecodeError(f"tool {index} of {len(tools)} at {self.at}")
        return tools[index]


def _decode_state(cls: type[TraceState], data: bytes) -> TraceState:
    if len(data) < _HEADER_BYTES:
        raise StateDecodeError(f"truncated: {len(data)} bytes, shorter than the header")
    _mark, version, last_seen = _HEADER.unpack_from(data)
    if version < 5:
        raise StateDecodeError(f"binary state of version {version}: binary began with 5")
    reader = _Reader(data)
    state = cls(last_seen=last_seen)
    _read_scalars(reader, state)
    tools = [reader.text() for _ in range(reader.count())]
    window = CallWindow()
    for _ in range(reader.count()):
        tool = reader.tool(tools)
        forms = reader.byte()
        args = reader.digest(forms & 3)
        window.append((tool, args, reader.digest(forms >> 2)))
    polls = _poll_window()
    for _ in range(reader.count()):
        tool = reader.tool(tools)
        args = reader.digest(reader.byte())
        if args is None:
            raise StateDecodeError(f"a poll without arguments at {reader.at}")
        polls.append((tool, args))
    _read_calls(reader, state)
    if reader.at < len(data) and data[reader.at] == _AGENT_TREE_SECTION:
        reader.byte()
        try:
            state.agent_tree = AgentTree.from_record(json.loads(reader.text()))
        except (ValueError, KeyError, TypeError) as exc:
            raise StateDecodeError(f"agent tree: {type(exc).__name__}: {exc}") from exc
    state.window_marks = _aligned(state.window_marks, len(window))
    # A later version appends sections after these; trailing bytes of this one are garbage.
    if version == STATE_VERSION and reader.at != len(data):
        raise StateDecodeError(f"{len(data) - reader.at} bytes after the state")
    window.memo = None
    state.window = window
    state.polls = polls
    return state


def _read_scalars(reader: _Reader, state: TraceState) -> None:
    flags = reader.byte()
    state.service = reader.text()
    if flags & _AGENT_NAME:
        state.agent_name = reader.text()
    if flags & _RELEASED:
        state.released_at = _FLOAT.unpack(reader.raw(_FLOAT.size))[0]
    state.aggregate_tokens = reader.signed()
    if flags & _INFERENCE_TOKENS:
        state.inference_tokens = reader.signed()
    if flags & _PRICED:
        has_inference_cost = reader.byte()
        inference_cost = reader.signed()
        state.inference_cost = inference_cost if has_inference_cost else None
        state.aggregate_cost = reader.signed()
        state.unpriced_tokens = reader.signed()
    if flags & _CONVERSATION:
        state.conversation_id = reader.text()
    state.fired = {Fired.parse(reader.text()) for _ in range(reader.count())}
    if flags & _CYCLE_RUNS:
        state.cycle_runs = [reader.uint() for _ in range(reader.count())]


def _read_calls(reader: _Reader, state: TraceState) -> None:
    raw = reader.raw(8 * reader.count())
    span_ids = [raw[i : i + 8] for i in range(0, len(raw), 8)]
    state.recent_span_ids = RecentIds(raw)
    previous = base = reader.uint()
    marks = bytearray()
    for _ in range(reader.count()):
        at = reader.uint()
        if at > len(span_ids):
            raise StateDecodeError(f"span id {at} of {len(span_ids)} at {reader.at}")
        marks += span_ids[at - 1] if at else reader.raw(8)
        micros = reader.time(previous)
        marks += micros.to_bytes(8, "big")
        previous = micros or previous
    state.window_marks = bytes(marks)
    raw = reader.raw(8 * reader.count())
    ends = RecentCalls()
    previous = base
    for at in range(0, len(raw), 8):
        micros = reader.time(previous)
        ends.remove(raw[at : at + 8])
        ends.add(raw[at : at + 8], micros)
        previous = micros or previous
    state.recent_call_ids = ends
