"""LiteLLM's proxy spans: the tool calls a model request answers (docs/conventions.md).

The proxy makes no tool span: a call shows up as the model's `tool_calls` in one request's
history and its result as the `tool` messages that close the next request."""

from __future__ import annotations

import hashlib
from typing import Any

from spanguard.detection.conventions.decoding import decode_arguments
from spanguard.detection.conventions.events import MISSING, ToolCall
from spanguard.detection.conventions.keys import GATEWAY_SCOPE, INPUT_MESSAGES
from spanguard.detection.conventions.values import AttributeMap, _text, bounded_text


def gateway_calls(span: Any, scope: str = GATEWAY_SCOPE) -> list[ToolCall]:
    """The tool calls a LiteLLM proxy span's request answers: the `tool` messages that end its
    `gen_ai.input.messages`, each with the call of the assistant message before them that it
    answers (name, arguments, id). Empty when the request ends otherwise (a user's message,
    the first request of a run) or records no messages."""
    attributes: AttributeMap = span.attributes
    if INPUT_MESSAGES not in attributes:
        return []
    messages = decode_arguments(_text(attributes[INPUT_MESSAGES]))
    if type(messages) is not list:
        return []
    first = len(messages)
    while first and _role(messages[first - 1]) == "tool":
        first -= 1
    if first == len(messages) or first == 0 or _role(messages[first - 1]) != "assistant":
        return []
    results: dict[str, Any] = {}
    for message in messages[first:]:
        call_id = message.get("tool_call_id")
        if isinstance(call_id, str):
            results[call_id] = _message_content(message)
    asked = messages[first - 1].get("tool_calls")
    calls: list[ToolCall] = []
    for index, call in enumerate(asked if type(asked) is list else ()):
        function = call.get("function") if type(call) is dict else None
        if type(function) is not dict or not isinstance(function.get("name"), str):
            continue
        call_id = call.get("id") if isinstance(call.get("id"), str) else None
        arguments = function.get("arguments", MISSING)
        calls.append(
            ToolCall(
                # One span, several calls: each its own id (the guard drops a repeated span id),
                # the same on every redelivery of the span.
                span_id=_derived_span_id(span.span_id, call_id or str(index)),
                tool_name=bounded_text(function["name"]),
                arguments=decode_arguments(arguments) if type(arguments) is str else arguments,
                call_id=bounded_text(call_id) if call_id else None,
                agent_name=None,
                match_attributes=None,
                result=results.get(call_id, MISSING) if call_id else MISSING,
                scope=scope,
                # The tool ran before this request was sent; when it started is not recorded.
                end_time_unix_nano=span.start_time_unix_nano,
                start_time_unix_nano=0,
            )
        )
    return calls


def _role(message: Any) -> Any:
    return message.get("role") if type(message) is dict else None


def _message_content(message: dict[str, Any]) -> Any:
    """A tool message's result: OpenAI's `content`, or the text of its GenAI `parts`."""
    content = message.get("content", MISSING)
    if content is MISSING:
        parts = message.get("parts")
        texts = [
            part.get("content") for part in parts if type(part) is dict
        ] if type(parts) is list else []  # fmt: skip
        if len(texts) == 1:
            content = texts[0]
        elif texts:
            content = "".join(text for text in texts if isinstance(text, str))
    return decode_arguments(content) if type(content) is str else content


def _derived_span_id(span_id: bytes, call_id: str) -> bytes:
    return hashlib.sha256(span_id + call_id.encode("utf-8", "surrogatepass")).digest()[:8]
