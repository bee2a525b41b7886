"""The compact form of a recorded agent run, shared by every extractor in this folder.

Each extractor reads one public source (a repository snapshot pinned by commit) and writes
`tests/fixtures/realruns/<name>.jsonl.gz`: one run a line, as `run_record` builds it. The
tests turn each run into OTLP spans with the OpenTelemetry SDK (tests/support/realruns.py)
and replay them through the guard.

A run's steps, in the order they happened:
    {"type": "user", "text": str}            a user's (or user simulator's) message
    {"type": "model", "text": str}           a model turn; its tool calls follow it
    {"type": "tool", "name": str, "id": str | None, "arguments": <JSON value>,
     "result": str | None, "error": bool | None}
Long strings are trimmed by `trim` (the head kept, the whole text's digest and length
appended, so two results equal after trimming were equal before it); credentials are
replaced by `scrub` before anything is written.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "realruns"
HEAD = 1500
LIMIT = 2000
TEXT_LIMIT = 600  # user and model text: enough to read the run by hand

_SECRETS = [
    re.compile(r"sk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}"),
    re.compile(r"AKIA[0-9A-Z]{16}"),
    re.compile(r"gh[pousr]_[A-Za-z0-9]{30,}"),
    re.compile(r"xox[abposr]-[A-Za-z0-9\-]{10,}"),
    re.compile(r"AIza[0-9A-Za-z_\-]{35}"),
    re.compile(r"hf_[A-Za-z0-9]{30,}"),
    re.compile(
        r"(?i)(api[_-]?key|secret|password|token|authorization)(\"?\s*[:=]\s*\"?)([^\s\"',}]{12,})"
    ),
]


def scrub(text: str) -> str:
    """`text` with anything shaped like a credential replaced by `[REDACTED]`."""
    for pattern in _SECRETS[:-1]:
        text = pattern.sub("[REDACTED]", text)
    return _SECRETS[-1].sub(lambda m: m.group(1) + m.group(2) + "[REDACTED]", text)


def trim(text: str, limit: int = LIMIT, head: int = HEAD) -> str:
    """`text` cut to its head when longer than `limit`, with the whole text's digest and length
    appended: trimmed texts are equal exactly when the texts were."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{text[:head]}...[trimmed: {len(text)} chars, sha256 {digest}]"


def clean(value: Any) -> Any:
    """A JSON value with every string scrubbed and trimmed."""
    if isinstance(value, str):
        return trim(scrub(value))
    if isinstance(value, list):
        return [clean(item) for item in value]
    if isinstance(value, dict):
        return {str(key): clean(item) for key, item in value.items()}
    return value


def user_step(text: str | None) -> dict[str, Any]:
    return {"type": "user", "text": trim(scrub(text or ""), TEXT_LIMIT, TEXT_LIMIT - 100)}


def model_step(text: str | None) -> dict[str, Any]:
    return {"type": "model", "text": trim(scrub(text or ""), TEXT_LIMIT, TEXT_LIMIT - 100)}


def tool_step(
    name: str, call_id: str | None, arguments: Any, result: str | None, error: bool | None
) -> dict[str, Any]:
    return {
        "type": "tool",
        "name": name,
        "id": call_id,
        "arguments": clean(arguments),
        "result": None if result is None else trim(scrub(result)),
        "error": error,
    }


def run_record(
    run: str,
    *,
    repo: str,
    commit: str,
    path: str,
    harness: str,
    model: str | None,
    kind: str,
    outcome: str | None,
    reward: float | None,
    steps: list[dict[str, Any]],
) -> dict[str, Any]:
    """One run. `kind`: service, coding or research; `outcome`: success, failure or None."""
    assert kind in ("service", "coding", "research"), kind
    assert outcome in ("success", "failure", None), outcome
    assert len(commit) == 40, commit
    return {
        "run": run,
        "source": {"repo": repo, "commit": commit, "path": path},
        "harness": harness,
        "model": model,
        "kind": kind,
        "outcome": outcome,
        "reward": reward,
        "steps": steps,
    }


def numbered(run_id: str, seen: Counter[str]) -> str:
    """`run_id`, with a counter appended when `seen` has had it before (a repeated simulation)."""
    seen[run_id] += 1
    return run_id if seen[run_id] == 1 else f"{run_id}#{seen[run_id]}"


def write_runs(name: str, runs: Iterable[dict[str, Any]]) -> Path:
    """Write `runs` to tests/fixtures/realruns/<name>.jsonl.gz (deterministic bytes)."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    target = FIXTURES / f"{name}.jsonl.gz"
    with open(target, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
        for run in runs:
            out.write(json.dumps(run, ensure_ascii=False, sort_keys=True).encode() + b"\n")
    return target


def read_runs(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]
