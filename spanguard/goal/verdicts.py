"""What a judge answers, read strictly: a verdict, or a JudgeError, never a silent pass."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

from spanguard.errors import JudgeError

if TYPE_CHECKING:
    from spanguard.goal.invocations import InvocationEnd

__all__ = ["Judge", "Verdict", "excerpt", "parse_verdict"]


@dataclass(frozen=True, slots=True)
class Verdict:
    satisfied: bool
    confidence: float  # within [0, 1]
    reason: str


VERDICT_KEYS: Final = frozenset({"satisfied", "confidence", "reason"})
MAX_REPLY_CHARS: Final = 8_192
_FENCED = re.compile(r"```(?:json|JSON)?[ \t]*\n?(?P<body>.*?)\n?[ \t]*```", re.DOTALL)


def parse_verdict(text: str) -> Verdict:
    """Parse a judge's reply STRICTLY: one JSON object with exactly `satisfied` (a boolean),
    `confidence` (a number within [0, 1]) and `reason` (a non-empty string), alone or fenced
    in ```json ... ``` with nothing around the fence. Anything else raises JudgeError."""
    if not isinstance(text, str):
        raise JudgeError(f"the reply is not text but {type(text).__name__}")
    body = text.strip()
    if not body:
        raise JudgeError("the reply is empty")
    if len(body) > MAX_REPLY_CHARS:
        raise JudgeError(f"the reply is {len(body)} characters long, not one small JSON object")
    if body.startswith("```"):
        fenced = _FENCED.fullmatch(body)
        if fenced is None:
            raise JudgeError(
                f"the reply has an unclosed code fence or text after it: {excerpt(body)}"
            )
        body = fenced.group("body").strip()
    try:
        document = json.loads(body, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except (ValueError, _StrictJsonError) as exc:
        raise JudgeError(f"the reply is not one JSON object ({exc}): {excerpt(body)}") from None
    if not isinstance(document, dict):
        raise JudgeError(f"the reply is JSON {type(document).__name__}, not an object")
    keys = set(document)
    if keys != VERDICT_KEYS:
        missing = sorted(VERDICT_KEYS - keys)
        extra = sorted(keys - VERDICT_KEYS)
        raise JudgeError(
            "the verdict must have exactly the keys satisfied, confidence, reason"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else "")
        )
    satisfied = document["satisfied"]
    confidence = document["confidence"]
    reason = document["reason"]
    if not isinstance(satisfied, bool):
        raise JudgeError(f"satisfied must be true or false, not {satisfied!r}")
    if isinstance(confidence, bool) or not isinstance(confidence, int | float):
        raise JudgeError(f"confidence must be a number, not {confidence!r}")
    if not 0.0 <= confidence <= 1.0:
        raise JudgeError(f"confidence must be within [0, 1], not {confidence!r}")
    if not isinstance(reason, str) or not reason.strip():
        raise JudgeError(f"reason must be a non-empty string, not {reason!r}")
    return Verdict(satisfied=satisfied, confidence=float(confidence), reason=reason.strip())


class _StrictJsonError(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _StrictJsonError(f"duplicate key {key!r}")
        document[key] = value
    return document


def _no_constants(name: str) -> Any:
    raise _StrictJsonError(f"{name} is not JSON")


def excerpt(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


@runtime_checkable
class Judge(Protocol):
    async def judge(self, invocation: InvocationEnd) -> Verdict:
        """A verdict on whether the invocation's answer did what its request asked; JudgeError
        if none could be had."""
        ...
