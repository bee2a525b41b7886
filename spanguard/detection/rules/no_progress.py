"""no_progress: different calls of one tool that all come back with one same result that says
nothing came back: an empty list, object or string, null, an error, or a "no results" text.

Different calls answered by one same *content* are not a stall: edits each answered
`{"ok": true}`, searches answered by one canned text, a tool that returns a fixed
acknowledgement. Only a result that carries nothing counts, so this rule fires on the agent
that rephrases its query against an empty index and stays quiet on healthy work. The result is
recognised from its value when the span carries it, or from its hash (an agent hashing
before the span leaves) against the hashes of the same empty shapes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from itertools import islice
from typing import TYPE_CHECKING, Any

from spanguard.detection.canonical import args_hash
from spanguard.detection.conventions import MISSING
from spanguard.detection.rules.base import ToolCallRule, Trip

if TYPE_CHECKING:
    from spanguard.detection.conventions import ToolCall
    from spanguard.detection.trace_state import CallKey, TraceState
    from spanguard.schemas.policy import AgentPolicy

__all__ = ["EMPTY_RESULT_DIGESTS", "NoProgress", "says_nothing"]

# Texts that say nothing came back (compared lower-case, without surrounding punctuation).
NOTHING_TEXTS = frozenset(
    {
        "",
        "[]",
        "{}",
        "null",
        "none",
        "no results",
        "no result",
        "no results found",
        "no result found",
        "no matches",
        "no matches found",
        "no match found",
        "no documents found",
        "no data",
        "nothing found",
        "not found",
        "0 results",
        "0 results found",
        "0 documents found",
        "empty",
    }
)
# Keys under which a count of zero means "nothing" (`{"results": [], "total": 0}`).
COUNT_KEYS = frozenset({"count", "total", "total_count", "totalcount", "num_results", "hits"})
# Keys of an error: `{"error": ...}`, MCP's `{"isError": true, ...}`, `{"status": "error"}`.
ERROR_STATUSES = frozenset({"error", "failed", "failure"})
_ERROR_TEXT = re.compile(r"^\s*(error|exception|traceback)\b", re.IGNORECASE)
_TRIM = " \t\r\n.!:;\"'`"


def _text_says_nothing(text: str) -> bool:
    return text.strip(_TRIM).lower() in NOTHING_TEXTS or bool(_ERROR_TEXT.match(text))


def says_nothing(value: Any, depth: int = 0) -> bool:
    """Whether a tool's result (decoded JSON-like value) says nothing came back."""
    if value is None or value is MISSING:
        return value is None
    if isinstance(value, str):
        return _text_says_nothing(value)
    if isinstance(value, list | tuple):
        return not value or (depth < 4 and all(says_nothing(item, depth + 1) for item in value))
    if isinstance(value, Mapping):
        if not value:
            return True
        if value.get("isError") is True or value.get("is_error") is True:
            return True  # MCP's CallToolResult of a failed call
        status = value.get("status")
        if isinstance(status, str) and status.lower() in ERROR_STATUSES:
            return True
        if "_raw" in value and len(value) == 1:  # a text that is not JSON (conventions.py)
            raw = value["_raw"]
            return isinstance(raw, str) and _text_says_nothing(raw)
        if value.keys() == {"error"} and value["error"]:
            return True
        if depth >= 4:
            return False
        return all(
            (key.lower() in COUNT_KEYS and item == 0)
            or (not isinstance(item, bool) and says_nothing(item, depth + 1))
            for key, item in value.items()
            if isinstance(key, str) and key not in ("isError", "is_error")  # False: no error
        )
    return False  # numbers and booleans are content


def _shapes() -> list[Any]:
    """Results that say nothing as tools and instrumentations record them, for results known
    only by their hash: a bare value or text, and the wrappers instrumentations put around a
    tool's return value (Google ADK's {"result": ...}, strands' [{"text": ...}], MCP content)."""
    texts = ["", "[]", "{}", "null", "none", "None", "no results", "No results"]
    texts += ["No results found", "No results found.", "not found", "Not found"]
    texts += ["No matches found", "No documents found", "0 results"]
    values: list[Any] = [None, [], {}, *texts, *({"_raw": text} for text in texts)]
    values += [{key: []} for key in ("results", "items", "documents", "data", "content")]
    shapes = list(values)
    for value in values:
        shapes.append({"result": value})
        shapes.append({"output": value})
    for text in texts:
        shapes.append([{"text": text}])
        shapes.append({"content": [{"type": "text", "text": text}]})
        shapes.append({"content": [{"type": "text", "text": text}], "isError": False})
    shapes.append({"content": [], "isError": False})
    return shapes


EMPTY_RESULT_DIGESTS: frozenset[str] = frozenset(
    args_hash(shape, frozenset()) for shape in _shapes()
)


class NoProgress(ToolCallRule):
    name = "no_progress"
    catches = (
        "`threshold` different calls of one tool in the loop window, one same result that says"
        " nothing came back (empty, null, an error, no results)"
    )
    settings = "no_progress: {threshold: 4, action: flag}"
    default_action = "flag"

    def wanted(self, policy: AgentPolicy) -> str:
        return policy.no_progress_action

    def check(
        self, state: TraceState, call: ToolCall, key: CallKey, policy: AgentPolicy
    ) -> Trip | None:
        tool, digest, result = key
        if result is None or digest is None:
            return None
        if call.result is not MISSING:
            if not says_nothing(call.result):
                return None
        elif result not in EMPTY_RESULT_DIGESTS:
            return None
        distinct = {
            seen_digest
            for name, seen_digest, same in islice(reversed(state.window), policy.window)
            if name == tool and same == result and seen_digest is not None
        }
        if len(distinct) < policy.no_progress_threshold:
            return None
        steps = min(len(state.window), policy.window)
        return Trip(
            f"{len(distinct)} different {tool} calls in last {steps} steps all returned the"
            " same empty result",
            {
                "tool_name": tool,
                "result_hash": result,
                "hits": len(distinct),
                "window": policy.window,
                "steps": steps,
            },
            message=(
                f"Your last {len(distinct)} different {tool} calls all came back empty."
                " Rephrasing will not help: report what you have or try another tool."
            ),
        )
