"""The worker's release reader (connectors/releases.py): what it takes from the kill topic.

The records come from the same code that publishes them (`spanguard release`'s
`manual_decision` and the worker's signing); the reader's Kafka side runs in
tests/connectors/test_manual_kafka.py against the real broker.
"""

from __future__ import annotations

import ast
import json
import typing
from datetime import UTC, datetime
from pathlib import Path

from spanguard.config.settings import WorkerSettings
from spanguard.connectors.manual import manual_decision
from spanguard.connectors.releases import ReleaseReader, ReleaseSkip
from spanguard.schemas import decision
from spanguard.schemas.decision import KillSignal, sign
from tests.support.kafka_harness import SIGNING_KEY
from tests.support.python_source import parse_python

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
    assert releases.ignored == {
        ReleaseSkip.UNSIGNED: 1,
        ReleaseSkip.UNKNOWN_KEY: 1,
        ReleaseSkip.NOT_UTF8: 1,
    }


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


def test_every_kind_of_bad_signal_is_a_reason_to_skip() -> None:
    """The kinds read_signal raises (BadSignal literals, and the signature checks other than
    valid) are ReleaseSkip's members: an unknown kind would stop the reader's count."""
    source = Path(decision.__file__).read_text()
    raised = {
        node.args[0].value
        for node in ast.walk(parse_python(source))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "BadSignal"
        and isinstance(node.args[0], ast.Constant)
    }
    checks = set(typing.get_args(decision.SignatureCheck)) - {"valid"}
    assert raised and checks
    assert {skip.value for skip in ReleaseSkip} == raised | checks
