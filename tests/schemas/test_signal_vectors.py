"""The Python killswitch against the kill-signal vectors every language's client reads.

schemas/testdata/kill-signal-vectors.json is written by tests/support/signal_vectors.py;
clients/typescript and clients/go run the same vectors in their own tests. A vector marked
`python_lax` is decided strictly by those clients and not yet by this checkout's read_signal:
it is an expected failure here (strict: once read_signal decides it, the mark must go).
"""

from __future__ import annotations

import base64
import json
from datetime import datetime

import pytest

from spanguard.killswitch.signals import AgentKilled, SignalBook
from spanguard.schemas.decision import BadSignal, keyring, read_signal
from tests.support.signal_vectors import VECTORS, build

DOCUMENT = json.loads(VECTORS.read_text())
NOW = datetime.fromisoformat(DOCUMENT["now"].replace("Z", "+00:00"))


def value_of(vector: dict) -> bytes:
    if "value_base64" in vector:
        return base64.b64decode(vector["value_base64"])
    return vector["value"].encode("utf-8", "surrogatepass")


def keys_of(vector: dict) -> dict[str, bytes] | None:
    if vector["keys"] is None:
        return None
    return keyring([DOCUMENT["keys"][name] for name in vector["keys"]])


def verdict(vector: dict):
    try:
        signal = read_signal(value_of(vector), keys_of(vector), NOW)
    except BadSignal as bad:
        return bad.kind, None
    return "obey", signal


def test_the_file_is_what_the_generator_writes():
    assert json.loads(json.dumps(build())) == DOCUMENT


def test_the_key_ids_are_the_keys_own():
    assert {name: next(iter(keyring(key))) for name, key in DOCUMENT["keys"].items()} == DOCUMENT[
        "key_ids"
    ]


@pytest.mark.parametrize(
    "vector",
    [
        pytest.param(
            vector,
            id=vector["name"],
            marks=[pytest.mark.xfail(strict=True, reason="read_signal is laxer than the vector")]
            if vector.get("python_lax")
            else [],
        )
        for vector in DOCUMENT["vectors"]
    ],
)
def test_each_vector_gets_its_verdict(vector):
    kind, signal = verdict(vector)
    assert kind == vector["verdict"]
    if signal is not None:
        expected = vector["signal"]
        assert {name: getattr(signal, name) for name in expected} == expected


@pytest.mark.parametrize("sequence", DOCUMENT["sequences"], ids=lambda s: s["name"])
def test_each_sequence_through_the_signal_book(sequence):
    keys = keyring(DOCUMENT["keys"]["current"])
    book = SignalBook()
    for step in sequence["steps"]:
        if "deliver" in step:
            record = sequence["signals"][step["deliver"]].encode()
            assert book.deliver(read_signal(record, keys, NOW)) is step["new"], step
            continue
        if step["expect"] == "killed":
            with pytest.raises(AgentKilled):
                book.check(step["check"])
        else:
            expected = None if step["expect"] == "pass" else step["expect"]
            assert book.check(step["check"]) == expected, step
