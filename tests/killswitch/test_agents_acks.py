"""`spanguard explain` on the agents' acks: obeyed, not obeyed within N s, pending, forged."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from spanguard.detection.explain import explain_records
from spanguard.killswitch.acks import ack_record, ack_status
from spanguard.schemas.decision import keyring
from tests.support.spans import kill_signal

KEY = b"acks-test-signing-key-0123456789"


def decision(trace_id: str, signal_id: str, detected_at: datetime) -> dict:
    return {
        "trace_id": trace_id,
        "decision_id": signal_id,
        "rule": "tool_loop",
        "action": "kill",
        "reason": "search_docs called 4x in last 4 steps",
        "detected_at": detected_at.isoformat(timespec="milliseconds"),
        "agent": {"service": "support-bot"},
    }


def checked(ack: dict, keys: bytes | None = KEY) -> dict:
    """An ack as `explain` reads it back: with its signature's status."""
    return {**ack, "_signature": ack_status(ack, keyring(keys) if keys else None)}


def test_an_acked_kill_is_obeyed_by_its_process_and_when():
    signal = kill_signal(uuid.uuid4().hex)
    detected = datetime.fromisoformat(signal.detected_at)
    record = decision(signal.trace_id, signal.signal_id, detected)
    ack = ack_record(signal, obeyed_at=detected + timedelta(milliseconds=420), key=KEY,
                     process="agent-7:4242")  # fmt: skip
    text = explain_records(signal.trace_id, [record], [checked(ack)])
    assert "  obeyed: by agent-7:4242 at " in text and "(420 ms after the decision)" in text
    assert "not obeyed" not in text


def test_no_ack_is_not_obeyed_after_n_seconds_and_pending_before():
    signal = kill_signal(uuid.uuid4().hex)
    detected = datetime.fromisoformat(signal.detected_at)
    record = decision(signal.trace_id, signal.signal_id, detected)
    later = explain_records(signal.trace_id, [record], [], now=detected + timedelta(seconds=30))
    assert "not obeyed: no agent acknowledged it within 10 s" in later
    soon = explain_records(signal.trace_id, [record], [], now=detected + timedelta(seconds=2))
    assert "not acknowledged yet (2.0 s after the decision)" in soon
    # Without the ack topic read, explain says nothing either way.
    assert "obeyed" not in explain_records(signal.trace_id, [record])


def test_an_ack_signed_with_another_key_or_unsigned_is_not_obeyed():
    signal = kill_signal(uuid.uuid4().hex)
    detected = datetime.fromisoformat(signal.detected_at)
    record = decision(signal.trace_id, signal.signal_id, detected)
    forged = ack_record(signal, obeyed_at=detected, key=b"not-the-key-0123456789")
    unsigned = ack_record(signal, obeyed_at=detected, key=None)
    text = explain_records(
        signal.trace_id, [record], [checked(forged), checked(unsigned)],
        now=datetime.now(UTC) + timedelta(hours=1),
    )  # fmt: skip
    assert "ignored: signature unknown_key" in text and "ignored: signature unsigned" in text
    assert "not obeyed: no agent acknowledged it" in text


def test_an_ack_of_another_signal_does_not_count():
    signal, other = kill_signal(uuid.uuid4().hex), kill_signal(uuid.uuid4().hex)
    detected = datetime.fromisoformat(signal.detected_at)
    record = decision(signal.trace_id, signal.signal_id, detected)
    ack = ack_record(other, obeyed_at=detected, key=KEY)
    text = explain_records(signal.trace_id, [record], [checked(ack)],
                           now=detected + timedelta(seconds=60))  # fmt: skip
    assert "not obeyed" in text
