"""What a tool's result is, as the rules compare it.

A result is one of four things, and the call's key (tool, args hash, result) carries which:
- `ERROR` (written e25300b07fd275ec): the call failed (the span's status is ERROR, it names an
  `error.type`, or the result is error-shaped: `Error: ...`, `{"error": ...}`, MCP's
  `isError: true`, a shell's or an editor's refusal on its first line). Every failure of one
  call is the same result, whatever its text: the same call failing again and again is a loop
  even when each error message differs.
- `EMPTY` (2a7e98419e2641ee): it found nothing (`[]`, `{}`, "No results found",
  `{"results": [], "total": 0}`).
- `NOTHING` (26b753427f18f012): it returns no content at all (`""` or null): a `think` tool, a
  command that prints nothing. Whether that is work done depends on the tool
  (rules/tool_loop.py, `repeats_without_new_work`).
- anything else: content, hashed like arguments (canonical JSON) after what changes on every
  execution is taken out: volatile keys (the policy's, and ids and times of an execution:
  `command_id`, `pid`, any `..._id`/`...Id`, `..._at`/`...At`), and in text UUIDs, timestamps,
  long hex ids, process numbers and name-number ids (`exec-7`, `certificate_7654321`). A write
  called twice whose results differ only by the new record's id is one result.

A result hashed before the span left (`spanguard.tool.result_hash`) is recognised as `EMPTY`
when it is the hash of an empty shape, and is content otherwise.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Final

from spanguard.detection.canonical import args_hash

__all__ = [
    "EMPTY",
    "EMPTY_RESULT_DIGESTS",
    "ERROR",
    "MARKERS",
    "NOTHING",
    "classify",
    "is_content",
    "result_key",
]


def _marker(name: str) -> str:
    """A marker is written where a result hash goes (decisions, kill signals' evidence), so it
    has a hash's shape: 16 hex digits, the digest of its name."""
    return hashlib.sha256(f"spanguard.result:{name}".encode()).hexdigest()[:16]


ERROR: Final = _marker("error")
EMPTY: Final = _marker("empty")
NOTHING: Final = _marker("nothing")
MARKERS: Final = frozenset({ERROR, EMPTY, NOTHING})

# Texts that say nothing came back (compared lower-case, without surrounding punctuation).
NOTHING_TEXTS: Final = frozenset(
    {
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
COUNT_KEYS: Final = frozenset(
    {"count", "total", "total_count", "totalcount", "num_results", "hits"}
)
# `{"status": "error"}` and its kin.
ERROR_STATUSES: Final = frozenset({"error", "failed", "failure"})
_ERROR_TEXT: Final = re.compile(r"^\s*(error|exception|traceback)\b", re.IGNORECASE)
# What tools and harnesses write when a call failed, anywhere in its first line: a shell's
# and an editor's refusals (SWE-agent's "Your proposed edit has introduced new syntax error(s)").
_FAILURE_TEXT: Final = re.compile(
    r"syntax error|command not found|no such file or directory|permission denied"
    r"|is not defined|cannot be (?:modified|cancelled|found)",
    re.IGNORECASE,
)
_FIRST_LINE_CHARS: Final = 300
_TRIM: Final = " \t\r\n.!:;\"'`"
_MAX_DEPTH: Final = 4

# What changes on every execution of one call, taken out of results before they are compared.
RESULT_VOLATILE_KEYS: Final = frozenset(
    {
        "id",
        "uuid",
        "pid",
        "command_id",
        "process_id",
        "execution_id",
        "run_id",
        "created_at",
        "updated_at",
        "started_at",
        "finished_at",
        "completed_at",
        "timestamp",
        "time",
        "date",
        "elapsed",
        "elapsed_ms",
        "duration",
        "duration_ms",
        "took",
    }
)
_VOLATILE_TEXT: Final = re.compile(
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"  # UUIDs
    r"|\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"  # times
    r"|\b[0-9a-f]{24,}\b"  # long hex ids (object ids, digests)
    r"|\b(?:pid|process|command_id|job)[ =:#]+\d+"  # a process's number
    r"|\b[A-Za-z][A-Za-z0-9]*[-_]\d+\b"  # a name and a number: exec-7, certificate_7654321
)
# Longer texts are compared as they are: the pass over them is bounded.
MAX_NORMALISED_CHARS: Final = 1 << 20


def _text_kind(text: str) -> str | None:
    stripped = text.strip(_TRIM)
    if not stripped:
        return NOTHING if not text.strip() else EMPTY
    if _ERROR_TEXT.match(text):
        return ERROR
    first = text[:_FIRST_LINE_CHARS].partition("\n")[0]
    if _FAILURE_TEXT.search(first):
        return ERROR
    if len(stripped) <= 24 and stripped.lower() in NOTHING_TEXTS:
        return EMPTY
    return None


def classify(value: Any, depth: int = 0) -> str | None:
    """ERROR, EMPTY or NOTHING for a result (decoded JSON-like value) that is one, None for
    content."""
    if value is None:
        return NOTHING
    if isinstance(value, str):
        return _text_kind(value)
    if isinstance(value, list | tuple):
        if not value:
            return EMPTY
        if depth >= _MAX_DEPTH:
            return None
        kinds = {classify(item, depth + 1) for item in value}
        if None in kinds:
            return None
        return ERROR if ERROR in kinds else EMPTY
    if isinstance(value, Mapping):
        if not value:
            return EMPTY
        if value.get("isError") is True or value.get("is_error") is True:
            return ERROR  # MCP's CallToolResult of a failed call
        status = value.get("status")
        if isinstance(status, str) and status.lower() in ERROR_STATUSES:
            return ERROR
        if "_raw" in value and len(value) == 1:  # a text that is not JSON (conventions/decoding.py)
            raw = value["_raw"]
            return _text_kind(raw) if isinstance(raw, str) else None
        if value.keys() == {"error"} and value["error"]:
            return ERROR
        if depth >= _MAX_DEPTH:
            return None
        found = EMPTY
        for key, item in value.items():
            if key in ("isError", "is_error") or not isinstance(key, str):
                continue
            if key.lower() in COUNT_KEYS and item == 0:
                continue
            if isinstance(item, bool):
                return None
            kind = classify(item, depth + 1)
            if kind is None:
                return None
            if kind == ERROR:
                found = ERROR
        return found
    return None  # numbers and booleans are content


def _normalised(value: Any, depth: int = 0) -> Any:
    """`value` without what changes on every execution (see the module's docstring)."""
    kind = type(value)
    if kind is str:
        if len(value) > MAX_NORMALISED_CHARS:
            return value
        return _VOLATILE_TEXT.sub("#", value)
    if depth >= 16:
        return value
    if kind is dict:
        return {
            key: _normalised(item, depth + 1)
            for key, item in value.items()
            if not (
                type(key) is str
                and (
                    key in RESULT_VOLATILE_KEYS
                    or key.endswith(("_id", "Id", "_at", "At"))  # ids, times (camelCase too)
                )
            )
        }
    if kind is list:
        return [_normalised(item, depth + 1) for item in value]
    return value


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


def result_key(
    result: Any, failed: bool, digest: str | None, volatile_keys: frozenset[str], missing: Any
) -> str | None:
    """The result part of a call's key: a marker, a hash of the content, or None when the
    span recorded no result (`missing`)."""
    if failed:
        return ERROR
    if digest is not None:  # hashed before the span left
        return EMPTY if digest in EMPTY_RESULT_DIGESTS else digest
    if result is missing:
        return None
    kind = classify(result)
    if kind is not None:
        return kind
    return args_hash(_normalised(result), volatile_keys)


def is_content(result: str | None) -> bool:
    """Whether a key's result part is content (or not recorded, which may be)."""
    return result is None or result not in MARKERS
