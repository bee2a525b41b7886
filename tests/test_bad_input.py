"""No input disables a guard: one table of bad inputs per surface that reads outside input.

Each surface gets its own table (a list of cases, one pytest parameter each) and one test that
runs every case through the real reader of that surface. A new surface adds a table here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from spanguard.killswitch.client import MAX_SIGNAL_BYTES, BadSignal, read_signal
from spanguard.schemas.decision import sign
from tests.support.spans import kill_signal

# -- the kill-signal topic (killswitch/client.py: read_signal) ----------------------------------

KEY = b"bad-input-test-signing-key"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _signal(**changes: Any) -> dict[str, Any]:
    record = kill_signal(TRACE).to_dict()
    record.update(changes)
    return record


def _signed(**changes: Any) -> bytes:
    return json.dumps(sign(_signal(**changes), KEY)).encode()


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"x": value}
    return value


def _tampered() -> bytes:
    record = sign(_signal(), KEY)
    record["reason"] = "edited after signing"
    return json.dumps(record).encode()


KILL_RECORDS: list[tuple[str, bytes | None, str]] = [
    ("no value (a tombstone)", None, "empty"),
    ("empty bytes", b"", "empty"),
    ("a JSON array", b"[]", "not_object"),
    ("JSON null", b"null", "not_object"),
    ("a JSON number", b"1", "not_object"),
    ("a JSON string", b'"kill"', "not_object"),
    ("not JSON", b"{", "not_json"),
    ("binary garbage", bytes(range(256)), "not_utf8"),
    ("UTF-16 JSON", json.dumps(_signal()).encode("utf-16"), "not_utf8"),
    (
        "NaN as a number",
        _signed(evidence={"span_id": "00f067aa0ba902b7", "hits": float("nan")}),
        "not_json",
    ),
    ("arrays nested past the decoder's depth", b"[" * 5000 + b"]" * 5000, "too_deep"),
    (
        "objects nested past a signal's depth",
        json.dumps(_signal(evidence=_nested(50))).encode(),
        "too_deep",
    ),
    ("larger than any signal", b" " * (MAX_SIGNAL_BYTES + 1), "too_large"),
    ("a lone surrogate escape", json.dumps(_signal(reason="\ud800")).encode(), "not_utf8"),
    ("an object that is no signal", b'{"kill": true}', "invalid"),
    ("trace id not hex", _signed(trace_id="x" * 32), "invalid"),
    ("trace id a number", _signed(trace_id=1), "invalid"),
    ("agent a string", _signed(agent="support-bot"), "invalid"),
    ("evidence an array", _signed(evidence=[]), "invalid"),
    ("an unknown kind", _signed(kind="pause"), "invalid"),
    ("a signature that is a number", json.dumps({**_signal(), "signature": 1}).encode(), "invalid"),
    ("unsigned", json.dumps(_signal()).encode(), "unsigned"),
    ("signed with another key", json.dumps(sign(_signal(), b"attacker")).encode(), "forged"),
    ("edited after signing", _tampered(), "forged"),
    ("a non-ASCII signature", json.dumps({**_signal(), "signature": "é" * 64}).encode(), "forged"),
]


@pytest.mark.parametrize(
    ("value", "kind"), [case[1:] for case in KILL_RECORDS], ids=[case[0] for case in KILL_RECORDS]
)
def test_kill_signal_records(value, kind):
    with pytest.raises(BadSignal) as caught:
        read_signal(value, KEY)
    assert caught.value.kind == kind
    assert len(caught.value.detail) < 260 and caught.value.detail.isprintable()


def test_a_valid_signal_reads_after_every_bad_record():
    for _, value, _ in KILL_RECORDS:
        with pytest.raises(BadSignal):
            read_signal(value, KEY)
    assert read_signal(_signed(), KEY).trace_id == TRACE
