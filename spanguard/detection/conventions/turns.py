"""Conversations and turns: which conversation a span names, and whether the user spoke."""

from __future__ import annotations

import re
from collections.abc import Container
from typing import Final

from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from spanguard.detection.conventions.keys import CONVERSATION_KEYS, PLACEHOLDER_CALL_IDS
from spanguard.detection.conventions.values import (
    MAX_TEXT_CHARS,
    AttributeMap,
    _text,
    bounded_text,
)

_LAST_ROLE: Final = re.compile(r'"role"\s*:\s*"([A-Za-z_]+)"')
# Google ADK passes what other agents of the run did to the next agent as a user message: a
# "For context:" part, then each event as "[agent] said: ...", "[agent] called tool ..." or
# "[agent] `tool` tool returned result: ...". No word from the user: a transfer is no new turn.
_ADK_OTHER_AGENTS: Final = re.compile(
    r'"For context:.{0,1000}?"\[[^"\]]{1,512}\] (?:said|called tool|`)'
)


def ends_with_user_message(value: AnyValue) -> bool:
    """Whether input messages (GenAI conventions' JSON) end with the user's: the user spoke
    since the agent's previous turn. The last `"role"` key outside a string is the last
    message's; one found inside a string is escaped (`\\"role\\"`), and skipped. A user
    message of tool results (`tool_call_response` parts), or Google ADK's account of what the
    run's other agents did (`_ADK_OTHER_AGENTS`), is no new word from the user."""
    text = value.string_value
    end = len(text)
    while True:
        at = text.rfind('"role"', 0, end)
        if at < 0:
            return False
        if at == 0 or text[at - 1] != "\\":
            found = _LAST_ROLE.match(text, at)
            # Some instrumentations (pydantic-ai) send tool results as the user's parts.
            return (
                found is not None
                and found.group(1) == "user"
                and "tool_call_response" not in text[at:]
                and _ADK_OTHER_AGENTS.search(text, at) is None
            )
        end = at


def conversation_of(attributes: AttributeMap, present: Container[str]) -> str | None:
    """The conversation a span names: the first non-empty of CONVERSATION_KEYS, at most
    MAX_TEXT_CHARS (a longer one is cut and hashed: still one id per conversation)."""
    for key in CONVERSATION_KEYS:
        if key in present:
            value = attributes[key]
            raw = value.string_value or _text(value)
            # Every span of a conversation names it again: the answer is kept per text.
            found = _conversation_ids.get(raw)
            if found is None:
                found = _conversation_id(raw)
                if len(raw) <= MAX_TEXT_CHARS:
                    if len(_conversation_ids) >= MAX_CONVERSATION_IDS_KEPT:
                        _conversation_ids.clear()
                    _conversation_ids[raw] = found
            if found:
                return found
    return None


# conversation_of's answers by the text a span gave ("" for none), bounded.
_conversation_ids: dict[str, str] = {}
MAX_CONVERSATION_IDS_KEPT: Final = 16_384


def _conversation_id(raw: str) -> str:
    """The conversation id `raw` names: "" when blank or a placeholder."""
    text = raw.strip()
    if not text or text.lower() in PLACEHOLDER_CALL_IDS:
        return ""
    return bounded_text(text)
