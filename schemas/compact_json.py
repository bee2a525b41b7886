"""Compact JSON for what the worker writes and reads on every batch: trace states, and the
records of the conversation and agent usage topics.

orjson where it is installed (the worker's extra), the standard library's json otherwise and
for what orjson refuses: an integer past 64 bits or a lone surrogate to write; NaN, a big
integer or another encoding than UTF-8 to read. Either way the bytes read back alike, and a
record json cannot read raises json's own error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["dumps", "loads"]

_fast_dumps: Callable[[Any], bytes] | None
_fast_loads: Callable[[bytes | str], Any] | None
_fast_error: type[Exception]
try:
    import orjson

    _fast_dumps, _fast_loads, _fast_error = orjson.dumps, orjson.loads, orjson.JSONDecodeError
except ImportError:
    _fast_dumps = _fast_loads = None
    _fast_error = ValueError


def dumps(value: Any) -> bytes:
    """`value` as JSON without spaces, UTF-8 (orjson writes text as UTF-8, json escapes what
    is not ASCII: both read back alike)."""
    if _fast_dumps is not None:
        try:
            return _fast_dumps(value)
        except TypeError:
            pass
    return json.dumps(value, separators=(",", ":")).encode()


def loads(data: bytes | str) -> Any:
    """What `data` holds, as json.loads reads it; its errors are json's (ValueError,
    UnicodeDecodeError)."""
    if _fast_loads is not None:
        try:
            return _fast_loads(data)
        except _fast_error:
            pass
    return json.loads(data)
