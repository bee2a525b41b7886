"""Reading one attribute value: as text, as a count, and text bounded in length."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Container, Mapping
from typing import Final

from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from spanguard.schemas.otlp import any_value_to_python

# A span's or resource's attributes in the request view: a map from key to AnyValue.
# Index it only with keys known to be present (indexing a missing key inserts it).
AttributeMap = Mapping[str, AnyValue]


# Names and ids are kept in every trace's state and copied into signals and detections: a
# megabyte-long tool name must cost a few hundred bytes, not a megabyte per changelog write.
MAX_TEXT_CHARS: Final = 200


def bounded_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """`text` itself when short; else its head and a hash of the whole, still unique."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{text[: limit - 30]}...sha256:{digest}"


def _first_int(
    attributes: AttributeMap, present: Container[str], keys: tuple[str, ...]
) -> int | None:
    for key in keys:
        if key not in present:
            continue
        value = attributes[key]
        count = value.int_value
        if count:  # a non-zero int_value is the value's kind (see _decode_value)
            return count if count > 0 else 0
        kind = value.WhichOneof("value")
        if kind == "int_value":
            return 0
        if kind == "double_value":
            if not math.isfinite(value.double_value):
                continue  # Infinity or NaN counts nothing; the span's other data still does
            return max(int(value.double_value), 0)
        if kind == "string_value" and value.string_value.strip().isdigit():
            return int(value.string_value)
    return None


def _first_text(
    attributes: AttributeMap, present: Container[str], keys: tuple[str, ...]
) -> str | None:
    for key in keys:
        if key in present:
            text = _text(attributes[key])
            if text:
                return text
    return None


def _text(value: AnyValue) -> str:
    text = value.string_value
    if text:  # a non-empty string_value is the value's kind (see _decode_value)
        return text
    kind = value.WhichOneof("value")
    if kind == "string_value" or kind is None:
        return ""
    python = any_value_to_python(value)
    if isinstance(python, bool):
        return "true" if python else "false"
    return python if isinstance(python, str) else json.dumps(python, sort_keys=True)
