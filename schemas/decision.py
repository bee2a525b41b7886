"""The wire contracts spanguard writes: detections (every decision) and kill signals.

`Decision` is what the core emits, what `spanguard replay` prints one per line and what goes to
the `spanguard-detections` topic; `KillSignal` is what agents read on `agent-kill-signals`.
Both have a JSON Schema beside this file, and tests validate what the code writes against them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Literal

import jsonschema

__all__ = [
    "DECISION_SCHEMA_VERSION",
    "EVIDENCE_FIELDS",
    "KILL_SIGNAL_SCHEMA_VERSION",
    "AgentIdentity",
    "Decision",
    "KillSignal",
    "canonical_json",
    "sign",
    "signature_valid",
    "validate",
]

DECISION_SCHEMA_VERSION = 1
KILL_SIGNAL_SCHEMA_VERSION = 1

# What a decision carries as evidence, when present: a kill signal's `evidence`, a page's
# custom details and the in-process decision span's attributes all take these.
EVIDENCE_FIELDS = (
    "tool_name",
    "args_hash",
    "hits",
    "window",
    "steps",
    "tokens",
    "token_budget",
    "confidence",
)

Rule = Literal["tool_loop", "token_budget", "goal_unmet"]
Action = Literal["kill", "downgrade", "flag"]


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    service: str
    name: str | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """One guard decision on one trace."""

    trace_id: str  # 32 lowercase hex
    span_id: str  # 16 lowercase hex: the span whose observation tripped the rule
    rule: Rule
    action: Action
    reason: str
    agent: AgentIdentity
    detected_at: str  # ISO 8601, UTC
    tool_name: str | None = None
    args_hash: str | None = None
    hits: int | None = None
    window: int | None = None  # the configured window size
    steps: int | None = None  # calls in the window when it tripped
    tokens: int | None = None
    token_budget: int | None = None
    autonomous: bool = False
    severity: str | None = None  # for paging: the agent's policy severity
    confidence: float | None = None  # goal_unmet: the judge's confidence
    system_message: str | None = None
    tool_arguments: Any = None  # only with policy record_arguments: true
    # When the tripping span ended (ISO 8601, UTC; None if it carried no end time): the start
    # of the detection latency, span end to signal sent.
    span_ended_at: str | None = None
    threshold: int | None = None  # tool_loop: the configured threshold
    # tool_loop: the window when it tripped, oldest first: {tool_name, args_hash, span_id,
    # ended_at} per call (hashes, never arguments)
    calls: list[dict[str, Any]] | None = None
    policy_entry: str | None = None  # the policy entry in force: "defaults" or "agents.N"
    policy_match: dict[str, str] | None = None  # that entry's match
    schema_version: int = DECISION_SCHEMA_VERSION
    decision_id: str = field(default="")

    def __post_init__(self) -> None:
        if not self.decision_id:
            # Deterministic, so a decision replayed after a crash carries the same id.
            digest = hashlib.sha256(f"{self.trace_id}:{self.rule}:{self.action}".encode())
            object.__setattr__(self, "decision_id", digest.hexdigest()[:32])

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        if record["tool_arguments"] is None:
            del record["tool_arguments"]
        return record

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Decision:
        values = dict(record)
        values["agent"] = AgentIdentity(**values["agent"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class KillSignal:
    """What an agent's killswitch reads: kill, or downgrade with a system message."""

    signal_id: str
    trace_id: str
    kind: Action
    rule: Rule
    reason: str
    evidence: dict[str, Any]
    agent: AgentIdentity
    detected_at: str
    system_message: str | None = None
    schema_version: int = KILL_SIGNAL_SCHEMA_VERSION

    @classmethod
    def from_decision(cls, decision: Decision) -> KillSignal:
        evidence: dict[str, Any] = {"span_id": decision.span_id}
        for name in EVIDENCE_FIELDS:
            value = getattr(decision, name)
            if value is not None:
                evidence[name] = value
        return cls(
            signal_id=decision.decision_id,
            trace_id=decision.trace_id,
            kind=decision.action,
            rule=decision.rule,
            reason=decision.reason,
            evidence=evidence,
            agent=decision.agent,
            detected_at=decision.detected_at,
            system_message=decision.system_message,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> KillSignal:
        values = {k: v for k, v in record.items() if k in cls.__dataclass_fields__}
        values["agent"] = AgentIdentity(**values["agent"])
        return cls(**values)


def canonical_json(record: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the record without `signature`, keys sorted, compact."""
    unsigned = {key: value for key, value in record.items() if key != "signature"}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sign(record: dict[str, Any], key: bytes) -> dict[str, Any]:
    """`record` with an HMAC-SHA256 `signature` (hex) over its canonical JSON."""
    signature = hmac.new(key, canonical_json(record), hashlib.sha256).hexdigest()
    return {**record, "signature": signature}


def signature_valid(record: dict[str, Any], key: bytes) -> bool:
    """Whether `record` carries a signature made with `key` over exactly its other fields."""
    signature = record.get("signature")
    if not isinstance(signature, str):
        return False
    expected = hmac.new(key, canonical_json(record), hashlib.sha256).hexdigest()
    return hmac.compare_digest(signature, expected)


@cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    text = resources.files("spanguard.schemas").joinpath(f"{name}.schema.json").read_text()
    return jsonschema.Draft202012Validator(json.loads(text))


def validate(record: dict[str, Any], schema: Literal["detection", "kill-signal"]) -> None:
    """Raise jsonschema.ValidationError when `record` breaks the named contract."""
    _validator(schema).validate(record)
