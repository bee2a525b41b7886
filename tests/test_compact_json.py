"""schemas/compact_json.py: orjson where installed, json for what orjson refuses; what one
writes the other reads alike, and what neither can read fails with json's own error."""

from __future__ import annotations

import json
import math

import pytest

from spanguard.schemas import compact_json


def test_what_it_writes_is_compact_json_that_json_reads_back():
    value = {"v": 2, "c": {"conv-é": [["c", "t", "00ff", 5, "x", None, None, "svc", None]]}}
    data = compact_json.dumps(value)
    assert isinstance(data, bytes) and b" " not in data
    assert json.loads(data) == value == compact_json.loads(data)


@pytest.mark.parametrize("odd", [2**70, -(2**70), "lone \ud800 surrogate"])
def test_what_orjson_refuses_to_write_is_written_by_json(odd):
    pytest.importorskip("orjson")
    data = compact_json.dumps({"value": odd})
    assert data == json.dumps({"value": odd}, separators=(",", ":")).encode()
    assert compact_json.loads(data) == {"value": odd}


@pytest.mark.parametrize(
    "data, expected",
    [
        (b'{"cost": 1180591620717411303424}', {"cost": 2**70}),  # past 64 bits
        ('{"when": 1.5}'.encode("utf-16"), {"when": 1.5}),  # json detects UTF-16
        (b'["\\ud800"]', ["\ud800"]),  # a lone surrogate, escaped
    ],
)
def test_what_orjson_refuses_to_read_is_read_by_json(data, expected):
    assert compact_json.loads(data) == expected == json.loads(data)


def test_nan_reads_as_json_reads_it():
    assert math.isnan(compact_json.loads(b"[NaN]")[0])


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe\x00", b'{"a": 1} trailing'])
def test_what_neither_reads_fails_with_jsons_error(data):
    with pytest.raises(ValueError) as raised:
        compact_json.loads(data)
    with pytest.raises(ValueError) as plain:
        json.loads(data)
    assert type(raised.value) is type(plain.value)
