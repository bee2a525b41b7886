"""A tool call's arguments and result: found on the span, decoded, unwrapped from the
envelopes some instrumentations put around them, or the hashes made before the span left."""

from __future__ import annotations

import ast
import json
from collections.abc import Container
from typing import Any, Final

from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from spanguard.detection.conventions.events import MISSING
from spanguard.detection.conventions.keys import (
    ARGUMENT_KEYS,
    EMPTY_WHEN_OFF_SCOPES,
    PLACEHOLDERS,
    RESULT_KEYS,
    STRANDS_RESULT_EVENT,
    STRANDS_TOOL_EVENT,
)
from spanguard.detection.conventions.values import AttributeMap, _text
from spanguard.schemas.otlp import any_value_to_python

MAX_REPR_CHARS: Final = 65_536
# The scanner json.loads uses (a decoder with its defaults): a value and where it ends.
_scan_json: Final = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


LANGCHAIN_ENVELOPE: Final = frozenset({"input_str", "tags", "metadata", "inputs", "kwargs"})


def _arguments(
    span: Any, attributes: AttributeMap, present: Container[str], oi_kind: str | None, scope: str
) -> tuple[Any, str | None]:
    """The call's arguments (MISSING when not recorded) and a call id found in an envelope."""
    for key in ARGUMENT_KEYS:
        if key not in present:
            continue
        if key == "tool.parameters" and oi_kind is not None:
            continue  # OpenInference: the parameter schema, the same for every call
        value = _decode_value(attributes[key], python_repr=key == "traceloop.entity.input")
        if type(value) is dict and value and not ("input_str" in value or "inputs" in value):
            return value, None  # the common case: a JSON object, recorded, no envelope
        arguments, call_id = _unwrap_envelope(value)
        if not _not_recorded(arguments, scope):
            return arguments, call_id
    events = span.events
    for event in events if len(events) else ():  # (an empty one would end on an IndexError)
        for kv in event.attributes:
            if kv.key == "gen_ai.tool.call.arguments" or (
                kv.key == "content" and event.name == STRANDS_TOOL_EVENT
            ):
                arguments, call_id = _unwrap_envelope(_decode_value(kv.value))
                if not _not_recorded(arguments, scope):
                    return arguments, call_id
    return MISSING, None


def _unwrap_envelope(value: Any) -> tuple[Any, str | None]:
    """LangChain's callback envelope, wherever it is met: the arguments inside, and the call id.

    `{"input_str", "tags", "metadata", "inputs", "kwargs"}` carries per-step metadata
    (`langgraph_step`, `checkpoint_ns`) that changes on every call: hashing it whole would make
    every call unique. `inputs` holds the arguments, else `input_str` (a Python repr)."""
    if type(value) is not dict or not ("input_str" in value or "inputs" in value):
        return value, None
    if not value.keys() <= LANGCHAIN_ENVELOPE:
        return value, None
    kwargs = value.get("kwargs")
    call_id = kwargs.get("tool_call_id") if type(kwargs) is dict else None
    call_id = call_id if isinstance(call_id, str) else None
    inputs = value.get("inputs")
    if inputs:
        return inputs, call_id
    input_str = value.get("input_str")
    if not isinstance(input_str, str):
        return MISSING, call_id
    return decode_arguments(input_str, python_repr=True), call_id


def _not_recorded(value: Any, scope: str) -> bool:
    if value is MISSING:
        return True
    if type(value) is str:
        return value.strip() in PLACEHOLDERS
    if type(value) is dict and not value:
        return scope in EMPTY_WHEN_OFF_SCOPES
    return False


def _result(span: Any, attributes: AttributeMap, present: Container[str], scope: str) -> Any:
    for key in RESULT_KEYS:
        if key not in present:
            continue
        result = _unwrap_result(_decode_value(attributes[key]))
        if not _not_recorded(result, scope):
            return result
    events = span.events
    # strands' legacy conventions: a gen_ai.choice event's message. Most spans have no events,
    # and iterating an empty repeated field costs an IndexError protobuf formats.
    for event in events if len(events) else ():
        for kv in event.attributes:
            if kv.key == "gen_ai.tool.call.result" or (
                kv.key == "message" and event.name == STRANDS_RESULT_EVENT
            ):
                result = _decode_value(kv.value)
                if not _not_recorded(result, scope):
                    return result
    return MISSING


def _unwrap_result(value: Any) -> Any:
    if type(value) is dict and "output" in value and value.keys() <= {"output", "kwargs"}:
        value = value["output"]  # OpenLLMetry's {"output": ..., "kwargs": ...}
    if type(value) is not dict:
        return value
    # A LangChain ToolMessage: its content, without the tool_call_id that changes every call.
    if _is_serialised_tool_message(value):
        return value["kwargs"].get("content")
    data = value.get("data")
    if value.get("type") == "tool" and type(data) is dict and "content" in data:
        return data["content"]
    # llama-index's ToolOutput repeats the call's input beside what the tool returned.
    if "raw_output" in value and "raw_input" in value and "tool_name" in value:
        return value["raw_output"]
    return value


def _is_serialised_tool_message(value: dict[str, Any]) -> bool:
    """LangChain's serialised ToolMessage, Python's or LangChain.js's, whatever its `lc` version.

    Python writes `kwargs.type == "tool"`; LangChain.js writes no type in kwargs, and names the
    class as the last element of `id` (`["langchain_core", "messages", "ToolMessage"]`)."""
    kwargs = value.get("kwargs")
    lc = value.get("lc")
    if type(kwargs) is not dict or type(lc) is not int or "content" not in kwargs:
        return False
    if kwargs.get("type") == "tool":
        return True
    class_path = value.get("id")
    return (
        value.get("type") == "constructor"
        and type(class_path) is list
        and bool(class_path)
        and class_path[-1] in ("ToolMessage", "ToolMessageChunk")
    )


def _digest(attributes: AttributeMap, key: str) -> str | None:
    """The hash under `key` (present), if it is one of ours: 16 hex digits."""
    text = _text(attributes[key]).strip().lower()
    return text if _is_hex_digest(text) else None


def _is_hex_digest(text: str) -> bool:
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


def _decode_value(value: AnyValue, *, python_repr: bool = False) -> Any:
    # A oneof member that is not set reads as its default: a non-empty string_value is the
    # value's kind, and one read answers the common case without WhichOneof.
    text = value.string_value
    if text:
        return decode_arguments(text, python_repr=python_repr)
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return decode_arguments(text, python_repr=python_repr)
    if kind is None:
        return MISSING
    return any_value_to_python(value)


def decode_arguments(text: str, *, python_repr: bool = False) -> Any:
    """Arguments recorded as text: JSON, else (LangChain) a Python literal, else the text itself.

    A bare string is what a one-argument tool's input is written as (OpenInference JS's
    `input.value` = `refund policy`), and what a truncated or malformed JSON document is."""
    try:
        try:
            # json.loads's own scanner without its whitespace handling: a whole document with
            # nothing around it (what instrumentations write) is decoded in one C call.
            value, end = _scan_json(text, 0)
            if end == len(text):
                return value
        except (StopIteration, ValueError):  # not JSON from its first character
            pass
        return json.loads(text)  # whitespace around, or not JSON: as json.loads says
    except ValueError:
        pass
    except RecursionError:  # nested past the decoder's depth: identical texts still key alike
        return {"_raw": text}
    return literal_or_text(text, python_repr=python_repr)


def literal_or_text(text: str, *, python_repr: bool) -> Any:
    """Arguments whose text is not JSON: (LangChain) a Python literal, else the text itself."""
    if python_repr and len(text) <= MAX_REPR_CHARS:
        try:
            return _jsonable(ast.literal_eval(text))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return text


def _jsonable(value: Any) -> Any:
    # Python literals hold tuples, sets and bytes, which JSON has not: give them a JSON shape.
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if isinstance(value, set | frozenset):
        return sorted((_jsonable(item) for item in value), key=repr)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, complex):
        return str(value)
    return value
