"""The worker's release reader (connectors/releases.py): what it takes from the kill topic.

The records come from the same code that publishes them (`spanguard release`'s
`manual_decision` and the worker's signing); the reader's Kafka side runs in
tests/connectors/test_manual_kafka.py against the real broker.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from spanguard.connectors.manual import manual_decision
from spanguard.connectors.releases import ReleaseReader
from spanguard.schemas.decision import KillSignal, sign
from spanguard.settings import WorkerSettings
from tests.support.kafka_harness import SIGNING_KEY

TRACE = "0af7651916cd43dd8448eb211c80319c"


def reader(**settings) -> ReleaseReader:
    return ReleaseReader(WorkerSettings(**settings), SIGNING_KEY.encode())


def record(action: str = "release", key: str | None = SIGNING_KEY, ttl: float = 3600) -> bytes:
    signal = KillSignal.from_decision(manual_decision(TRACE, action, "x", "alice"), ttl)
    value = signal.to_dict()
    if key is not None:
        value = sign(value, key.encode())
    return json.dumps(value).encode()


def now() -> float:
    return datetime.now(UTC).timestamp()


def test_a_signed_release_is_kept_with_the_time_it_was_issued():
    releases = reader()
    value = record()
    assert releases.accept(value, now())
    issued = datetime.fromisoformat(json.loads(value)["detected_at"]).timestamp()
    assert releases.released == {TRACE: issued} and releases.read == 1


def test_kills_unsigned_and_foreign_releases_are_not_releases():
    releases = reader()
    assert not releases.accept(record("kill"), now())
    assert not releases.accept(record(key=None), now())
    assert not releases.accept(record(key="another key of 32 bytes or more...."), now())
    assert not releases.accept(b"\xff not json", now())
    assert releases.released == {}
    assert releases.ignored == {"unsigned": 1, "unknown_key": 1, "not_utf8": 1}


def test_expiry_is_judged_when_the_record_was_appended():
    releases = reader()
    value = record(ttl=60)
    assert not releases.accept(value, now() + 3600)  # appended after it expired: refused
    assert releases.accept(value, now())  # appended in time, read an hour later: kept


def test_releases_older_than_the_horizon_are_pruned():
    releases = reader(state_ttl=600)
    releases.released.update({"a" * 32: now() - 601, "b" * 32: now() - 10})
    assert releases.prune() == 1
    assert list(releases.released) == ["b" * 32]
