"""The wire contracts spanguard writes: detections (every decision) and kill signals.

`Decision` is what the core emits, what `spanguard replay` prints one per line and what goes to
the `spanguard-detections` topic; `KillSignal` is what agents read on `agent-kill-signals`.
Both have a JSON Schema beside this file, and tests validate what the code writes against them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping
from copy import deepcopy
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import cache
from importlib import resources
from typing import Any, Literal, NoReturn

import jsonschema
from jsonschema.protocols import Validator

__all__ = [
    "DECISION_SCHEMA_VERSION",
    "DEFAULT_CONTAIN_SECONDS",
    "DEFAULT_SIGNAL_TTL_SECONDS",
    "EVIDENCE_FIELDS",
    "KILL_SIGNAL_SCHEMA_VERSION",
    "LINKED_CONVERSATION_PREFIX",
    "MAX_SIGNAL_BYTES",
    "MAX_TOOL_NAME_CHARS",
    "NO_EVIDENCE",
    "NO_POLICY",
    "NO_SPAN_ID",
    "NO_SPEND",
    "NO_TRACE_ID",
    "PAUSE_FIELDS",
    "SCOPE_FIELDS",
    "AgentIdentity",
    "BadSignal",
    "Decision",
    "DecisionScope",
    "Evidence",
    "KillSignal",
    "Pause",
    "PolicyInForce",
    "ScopeKind",
    "SignalScope",
    "SignatureCheck",
    "Spend",
    "ToolIdentity",
    "caller_trace_of",
    "canonical_json",
    "decision_id",
    "key_id",
    "keyring",
    "kill_signals",
    "linked_conversation",
    "pause_instructions",
    "read_signal",
    "schema_validator",
    "sign",
    "signature_valid",
    "tool_signal",
    "validate",
    "verify",
]

DECISION_SCHEMA_VERSION = 1
# 2: signals carry `expires_at`, and a signed one the `key_id` of its key.
KILL_SIGNAL_SCHEMA_VERSION = 2
# How long after its detection a signal is obeyed (the worker's SPANGUARD_SIGNAL_TTL).
DEFAULT_SIGNAL_TTL_SECONDS = 3600.0

# The record keys of what a decision carries as evidence (of its Evidence and its Spend), when
# present: a kill signal's `evidence`, a page's custom details and the in-process decision
# span's attributes all take these.
EVIDENCE_FIELDS = (
    "tool_name",
    "args_hash",
    "result_hash",
    "hits",
    "window",
    "steps",
    "tokens",
    "token_budget",
    "cost_micro_usd",
    "budget_micro_usd",
    "confidence",
)

# "manual": an operator's `spanguard kill` or `spanguard release`, not a rule of the guard.
Rule = Literal[
    "tool_loop",
    "cycle",
    "tool_polling",
    "no_progress",
    "token_budget",
    "cost_budget",
    "handoff_cycle",
    "delegation_depth",
    "agent_fan_out",
    "agent_budget",
    "goal_unmet",
    "manual",
    "tool_failing",
    "loop_signature",
]
# "release" (manual only): the trace's agent may call tools again, until a later kill.
# "pause": the agent waits for an operator's release or kill, or until `pause_until`, when
# `pause_fallback` applies.
# The fleet rules' (scope "tool"): "contain" (the tool refused to every client while the
# incident is open; "flag" records and notifies only) and "recovered" (the incident's second
# and last record: the tool answers again).
Action = Literal["kill", "downgrade", "flag", "release", "pause", "contain", "recovered"]
# A manual signal trips on no span: its span_id is this.
NO_SPAN_ID = "0" * 16
# What a kill signal may stop: one trace (the default, and every signal before scopes), every
# trace of one conversation, or every trace of one agent (service.name + gen_ai.agent.name; a
# null name: every agent of the service). Scoped signals are kills and releases only.
# A tool (its name, and its server: "" when none) is contained rather than stopped: the agents'
# calls to it are refused, the agents go on (see tool_signal).
SignalScope = Literal["trace", "conversation", "agent", "tool"]
# What a decision over more than its trace spans (DecisionScope): "tool" is the fleet's, one
# tool (or model) across every agent (spanguard/detection/fleet.py).
ScopeKind = Literal["conversation", "agent", "tool"]
# The trace id a scoped manual signal names: it stops no trace by its id.
NO_TRACE_ID = "0" * 32
# The conversation of the agent runs linked to one caller's trace: this, then its trace id.
LINKED_CONVERSATION_PREFIX = "trace:"
_TRACE_ID = re.compile(r"[0-9a-f]{32}")
# The agent a tool-scoped signal names: it is about every agent that calls the tool.
FLEET_SERVICE = "(fleet)"
# A conversation id a signal may carry (as a detection's).
MAX_CONVERSATION_ID_CHARS = 200
# A tool's name and its server's, as a tool-scoped signal carries them (bounded as a
# conversation id is).
MAX_TOOL_NAME_CHARS = 200
# How long a manual contain lasts unless the operator says (`spanguard contain --for`).
DEFAULT_CONTAIN_SECONDS = 3600.0


def pause_instructions(detection: Mapping[str, Any]) -> str | None:
    """For a pause: that the agent is waiting and how to answer (the page and the webhook
    carry it); None for any other action."""
    if detection.get("action") != "pause":
        return None
    trace_id = detection.get("trace_id")
    fallback = detection.get("pause_fallback") or "kill"
    then = "it is killed" if fallback == "kill" else "it goes on"
    return (
        f"the agent is waiting for an answer: `spanguard release {trace_id}` lets it go on,"
        f" `spanguard kill {trace_id} --reason TEXT` stops it; unanswered by"
        f" {detection.get('pause_until')}, {then}"
    )


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    service: str
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ToolIdentity:
    """A tool as a tool-scoped signal names it; `server` "" when the tool has none. A contain
    without a server holds for the tool of that name on every server."""

    name: str
    server: str = ""


def decision_id(trace_id: str, rule: str, action: str, released_at: float = 0.0) -> str:
    """A decision's id: deterministic, so a decision replayed after a crash carries the same
    id and agents drop it as a duplicate. A rule fires once per trace and action, and once
    more after each operator's release (`released_at`, when it was issued), so that decision
    gets a new id of its own."""
    text = f"{trace_id}:{rule}:{action}"
    if released_at:
        text += f":released:{released_at!r}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Evidence:
    """What a rule saw when it tripped: the repeated call and the window it counted it in
    (tool_loop, cycle, tool_polling, no_progress), or the judge's confidence (goal_unmet).
    Hashes, never arguments, but for `tool_arguments`."""

    tool_name: str | None = None
    args_hash: str | None = None
    result_hash: str | None = None  # the repeated result (tool_loop, no_progress), when recorded
    hits: int | None = None
    window: int | None = None  # the configured window size
    steps: int | None = None  # calls in the window when it tripped
    threshold: int | None = None  # tool_loop, cycle: the configured threshold
    # cycle: how many calls the repeated sequence has (the last `period` of `calls`)
    period: int | None = None
    # tool_loop, cycle: the window when it tripped, oldest first: {tool_name, args_hash,
    # span_id, ended_at} per call (hashes, never arguments)
    calls: list[dict[str, Any]] | None = None
    tool_arguments: Any = None  # only with policy record_arguments: true
    confidence: float | None = None  # goal_unmet: the judge's confidence
    # handoff_cycle: the agents of the repeated handoffs, in order; delegation_depth: the chain
    # of agents from the outermost known down to the deepest; agent_fan_out: the agents started;
    # a fleet incident (scope tool): the agents that called the tool, newest first
    agents: list[str] | None = None
    depth: int | None = None  # delegation_depth: agents nested in one another
    sub_agents: int | None = None  # agent_fan_out: agent runs the trace started


@dataclass(frozen=True, slots=True)
class Spend:
    """What the trace (conversation, agent window) spent when a budget tripped, and its budgets.

    Money is in whole micro-dollars: every killswitch reads integers exactly, not decimal
    fractions. The cost is set once usage is priced (cost_budget, and token_budget then); the
    unpriced tokens (cost_budget): those no price was found for."""

    tokens: int | None = None
    token_budget: int | None = None
    cost_micro_usd: int | None = None
    budget_micro_usd: int | None = None
    unpriced_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class PolicyInForce:
    """The policy entry a decision was taken under ("defaults" or "agents.N"), that entry's
    match, and what it says of the agent (for paging). A manual decision has none."""

    entry: str | None = None
    match: dict[str, str] | None = None
    severity: str | None = None
    autonomous: bool = False


@dataclass(frozen=True, slots=True)
class Pause:
    """Action pause: until when the agent waits for an operator (ISO 8601, UTC), and then
    "kill" or "release" (it goes on)."""

    until: str | None = None
    fallback: str | None = None


@dataclass(frozen=True, slots=True)
class DecisionScope:
    """A decision over more than its trace: "conversation" (the guard's conversation rules,
    spanguard/detection/conversation.py, or an operator's conversation kill) with its id and how
    many of its traces the evidence spans, or "agent" (the agent budget,
    spanguard/detection/agent_budget.py, or an operator's agent kill). `until`: when a kill of
    the scope lifts: the agent's budget window frees, or the conversation's kill expires (the
    policy's `conversation.kill_ttl` after the detection).

    "tool": a fleet incident (spanguard/detection/fleet.py): the `tool` (or `model:` key) and
    the `server` it names, if any; `traces`, the distinct traces that called it in the window;
    `trace_ids`, the traces it hit, newest first (at most fleet.MAX_LISTED; the agents hit are
    the evidence's `agents`)."""

    kind: ScopeKind | None = None
    conversation_id: str | None = None
    traces: int | None = None
    until: str | None = None
    tool: str | None = None
    server: str | None = None
    trace_ids: list[str] | None = None


NO_EVIDENCE = Evidence()
NO_SPEND = Spend()
NO_POLICY = PolicyInForce()


@dataclass(frozen=True, slots=True)
class Decision:
    """One guard decision on one trace.

    Its parts are typed; its record (`to_dict`, `to_json`) is flat, as it always was: the
    parts' fields are keys of the record itself (`_WIRE` maps them)."""

    trace_id: str  # 32 lowercase hex
    span_id: str  # 16 lowercase hex: the span whose observation tripped the rule
    rule: Rule
    action: Action
    reason: str
    agent: AgentIdentity
    detected_at: str  # ISO 8601, UTC
    evidence: Evidence = NO_EVIDENCE
    spend: Spend = NO_SPEND
    policy: PolicyInForce = NO_POLICY
    system_message: str | None = None
    # When the tripping span ended (ISO 8601, UTC; None if it carried no end time): the start
    # of the detection latency, span end to signal sent.
    span_ended_at: str | None = None
    operator: str | None = None  # manual: who issued it (`--operator`)
    pause: Pause | None = None  # action pause only
    scope: DecisionScope | None = None  # None: a decision of the trace alone
    schema_version: int = DECISION_SCHEMA_VERSION
    decision_id: str = field(default="")

    def __post_init__(self) -> None:
        if not self.decision_id:
            object.__setattr__(
                self, "decision_id", decision_id(self.trace_id, self.rule, self.action)
            )

    @property
    def scope_kind(self) -> ScopeKind | None:
        """ "conversation", "agent", "tool", or None (the trace's own)."""
        return self.scope.kind if self.scope is not None else None

    def signal_evidence(self) -> dict[str, Any]:
        """The EVIDENCE_FIELDS it has (not None), by their record keys."""
        evidence: dict[str, Any] = {}
        for key in EVIDENCE_FIELDS:
            value = self._wire_value(key)
            if value is not None:
                evidence[key] = value
        return evidence

    def _wire_value(self, key: str) -> Any:
        part, name = _WIRE_PLACES[key]
        holder = getattr(self, part) if part else self
        return None if holder is None else getattr(holder, name)

    def to_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {}
        for key, _, _, left_out_when_none in _WIRE:
            value = self._wire_value(key)
            if value is None and left_out_when_none:
                continue
            # Copies, as dataclasses.asdict made: a caller may change the record it gets.
            record[key] = asdict(value) if isinstance(value, AgentIdentity) else deepcopy(value)
        return record

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Decision:
        """The decision of a record; TypeError for a key no decision has or a missing one."""
        values = dict(record)
        parts: dict[str, dict[str, Any]] = {part: {} for part in _PARTS}
        for key, part, name, _ in _WIRE:
            if part and key in values:
                parts[part][name] = values.pop(key)
        if not values.keys().isdisjoint(_PARTS):  # a part's name is no key of a record
            raise TypeError(f"not keys of a record: {sorted(values.keys() & _PARTS.keys())}")
        for part, part_type in _PARTS.items():
            given = parts[part]
            if part in _PRESENT_WHEN_SET and all(value is None for value in given.values()):
                continue  # not a pause, or a decision of the trace alone
            values[part] = part_type(**given)
        values["agent"] = AgentIdentity(**values["agent"])
        return cls(**values)

    @classmethod
    def from_json(cls, data: str | bytes) -> Decision:
        """The decision in a record of the detections topic; ValueError if it holds none."""
        try:
            return cls.from_dict(json.loads(data))
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not a detection record: {exc!r}") from None


# The wire order of a detection record's keys (every record so far has them in this order):
# (key, the part of Decision that holds it ("": Decision itself), its name there, whether the
# key is left out when None). Records before a part existed stay as they were: a key left out
# when None is one that came later.
_WIRE: tuple[tuple[str, str, str, bool], ...] = (
    ("trace_id", "", "trace_id", False),
    ("span_id", "", "span_id", False),
    ("rule", "", "rule", False),
    ("action", "", "action", False),
    ("reason", "", "reason", False),
    ("agent", "", "agent", False),
    ("detected_at", "", "detected_at", False),
    ("tool_name", "evidence", "tool_name", False),
    ("args_hash", "evidence", "args_hash", False),
    ("result_hash", "evidence", "result_hash", False),
    ("hits", "evidence", "hits", False),
    ("window", "evidence", "window", False),
    ("steps", "evidence", "steps", False),
    ("tokens", "spend", "tokens", False),
    ("token_budget", "spend", "token_budget", False),
    ("autonomous", "policy", "autonomous", False),
    ("severity", "policy", "severity", False),
    ("confidence", "evidence", "confidence", False),
    ("system_message", "", "system_message", False),
    ("tool_arguments", "evidence", "tool_arguments", True),
    ("span_ended_at", "", "span_ended_at", False),
    ("threshold", "evidence", "threshold", False),
    ("calls", "evidence", "calls", False),
    ("period", "evidence", "period", False),
    ("policy_entry", "policy", "entry", False),
    ("policy_match", "policy", "match", False),
    ("operator", "", "operator", True),
    ("pause_until", "pause", "until", True),
    ("pause_fallback", "pause", "fallback", True),
    ("cost_micro_usd", "spend", "cost_micro_usd", True),
    ("budget_micro_usd", "spend", "budget_micro_usd", True),
    ("unpriced_tokens", "spend", "unpriced_tokens", True),
    ("scope", "scope", "kind", True),
    ("conversation_id", "scope", "conversation_id", True),
    ("traces", "scope", "traces", True),
    ("scope_until", "scope", "until", True),
    ("tool", "scope", "tool", True),
    ("server", "scope", "server", True),
    ("trace_ids", "scope", "trace_ids", True),
    ("agents", "evidence", "agents", True),
    ("depth", "evidence", "depth", True),
    ("sub_agents", "evidence", "sub_agents", True),
    ("schema_version", "", "schema_version", False),
    ("decision_id", "", "decision_id", False),
)
_WIRE_PLACES = {key: (part, name) for key, part, name, _ in _WIRE}
_PARTS: dict[str, type] = {
    "evidence": Evidence,
    "spend": Spend,
    "policy": PolicyInForce,
    "pause": Pause,
    "scope": DecisionScope,
}
# The parts a decision has only when one of their fields is set (None otherwise).
_PRESENT_WHEN_SET = frozenset({"pause", "scope"})
# The record keys of a pause, and of a scope (a page's custom details take them).
PAUSE_FIELDS = tuple(key for key, part, _, _ in _WIRE if part == "pause")
SCOPE_FIELDS = tuple(key for key, part, _, _ in _WIRE if part == "scope")


@dataclass(frozen=True, slots=True)
class KillSignal:
    """What an agent's killswitch reads: kill, or downgrade with a system message.

    `expires_at` bounds how long the signal is obeyed: a signal read after it (a replay of an
    old record, a consumer that was stopped for hours) is ignored. A kill already obeyed stays
    obeyed: the agent's SignalBook keeps it.
    """

    signal_id: str
    trace_id: str
    kind: Action
    rule: Rule
    reason: str
    evidence: dict[str, Any]
    agent: AgentIdentity
    detected_at: str
    expires_at: str
    system_message: str | None = None
    operator: str | None = None  # a manual signal: who issued it
    pause_until: str | None = None  # kind pause: see Decision
    pause_fallback: str | None = None
    # What it stops (see SignalScope; None: the trace, as every signal before scopes did); for
    # a conversation, its id; for an agent, `agent` names it.
    scope: SignalScope | None = None
    conversation_id: str | None = None
    tool: ToolIdentity | None = None  # scope tool: the tool contained (or released)
    schema_version: int = KILL_SIGNAL_SCHEMA_VERSION

    @property
    def stops(self) -> SignalScope:
        return self.scope or "trace"

    def scope_key(self) -> tuple[str, ...]:
        """What the signal stops, as a key: ("trace", id), ("conversation", id),
        ("agent", service, name or "") or ("tool", name, server)."""
        if self.scope == "conversation":
            return ("conversation", self.conversation_id or "")
        if self.scope == "agent":
            return ("agent", self.agent.service, self.agent.name or "")
        if self.scope == "tool" and self.tool is not None:
            return ("tool", self.tool.name, self.tool.server)
        return ("trace", self.trace_id.lower())

    def topic_key(self) -> bytes:
        """The kill topic's key for it: a scope's signals keep their order under one key
        (`conversation:ID`, `agent:SERVICE/NAME`, `tool:SERVER/NAME`), a trace's under its id."""
        if self.scope == "conversation":
            return f"conversation:{self.conversation_id}".encode()
        if self.scope == "agent":
            return f"agent:{self.agent.service}/{self.agent.name or ''}".encode()
        if self.scope == "tool" and self.tool is not None:
            return f"tool:{self.tool.server}/{self.tool.name}".encode()
        return self.trace_id.encode()

    def describe_target(self) -> str:
        """What it stops, for people: "trace X", "conversation X", "agent S/N", "tool T on S"."""
        if self.scope == "conversation":
            return f"conversation {self.conversation_id}"
        if self.scope == "agent":
            name = f"/{self.agent.name}" if self.agent.name else " (every agent name)"
            return f"agent {self.agent.service}{name}"
        if self.scope == "tool" and self.tool is not None:
            server = f" on {self.tool.server}" if self.tool.server else ""
            return f"tool {self.tool.name}{server}"
        return f"trace {self.trace_id}"

    def expired(self, now: datetime) -> bool:
        """Whether `now` (timezone-aware) is past the signal's expiry."""
        return now >= datetime.fromisoformat(self.expires_at)

    @classmethod
    def from_decision(
        cls, decision: Decision, ttl_seconds: float = DEFAULT_SIGNAL_TTL_SECONDS
    ) -> KillSignal:
        evidence: dict[str, Any] = {"span_id": decision.span_id, **decision.signal_evidence()}
        expires_at = (
            datetime.fromisoformat(decision.detected_at) + timedelta(seconds=ttl_seconds)
        ).isoformat(timespec="milliseconds")
        scope: SignalScope | None = None
        decided = decision.scope
        if decided is not None and decided.kind == "agent":
            # An agent kill lasts until its budget window frees, not the usual TTL.
            scope = "agent"
            if decided.until is not None:
                expires_at = decided.until
        elif decision.scope_kind == "conversation" and decision.rule == "manual":
            # An operator's conversation kill or release; the guard's conversation rules still
            # stop the trace that tripped them (the next turn trips them again).
            scope = "conversation"
        return cls(
            signal_id=decision.decision_id,
            trace_id=decision.trace_id,
            kind=decision.action,
            rule=decision.rule,
            reason=decision.reason,
            evidence=evidence,
            agent=decision.agent,
            detected_at=decision.detected_at,
            # From the detection time, so a signal re-sent after a crash is the same signal.
            expires_at=expires_at,
            system_message=decision.system_message,
            operator=decision.operator,
            pause_until=decision.pause.until if decision.pause is not None else None,
            pause_fallback=decision.pause.fallback if decision.pause is not None else None,
            scope=scope,
            conversation_id=(
                decided.conversation_id if decided is not None and scope == "conversation" else None
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        for name in ("operator", *PAUSE_FIELDS, "scope", "conversation_id", "tool"):
            if record[name] is None:
                del record[name]  # the signals of the guard's rules are as they always were
        return record

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> KillSignal:
        values = {k: v for k, v in record.items() if k in cls.__dataclass_fields__}
        values["agent"] = AgentIdentity(**values["agent"])
        if values.get("tool") is not None:
            values["tool"] = ToolIdentity(**values["tool"])
        return cls(**values)


def tool_signal(
    tool: str,
    server: str,
    rule: Rule,
    reason: str,
    decision_id: str,
    expires_at: str,
    *,
    kind: Literal["kill", "release"] = "kill",
    detected_at: str | None = None,
    operator: str | None = None,
) -> KillSignal:
    """The signal that contains a tool (`kind` kill: every client refuses calls to it, the
    agents go on) or lifts its containment (`release`), unsigned (sign its `to_dict()`).

    `server` is "" when the tool has none; `rule` a fleet rule (`tool_failing`,
    `loop_signature`; its release is the rule's recovery) or `manual` with `operator`;
    `decision_id` becomes the signal id (32 hex: the same decision re-sent is a duplicate);
    `expires_at` (RFC 3339 with a zone) bounds the containment. The newest signal of a tool
    (by `detected_at`, default now) is the one a client obeys."""
    if not 0 < len(tool) <= MAX_TOOL_NAME_CHARS or len(server) > MAX_TOOL_NAME_CHARS:
        raise ValueError(f"a tool's name has 1 to {MAX_TOOL_NAME_CHARS} characters, its server"
                         f" at most {MAX_TOOL_NAME_CHARS}")  # fmt: skip
    return KillSignal(
        signal_id=decision_id,
        trace_id=NO_TRACE_ID,
        kind=kind,
        rule=rule,
        reason=reason,
        evidence={"span_id": NO_SPAN_ID, "tool_name": tool},
        agent=AgentIdentity(FLEET_SERVICE),
        detected_at=detected_at or datetime.now(UTC).isoformat(timespec="milliseconds"),
        expires_at=expires_at,
        operator=operator,
        scope="tool",
        tool=ToolIdentity(tool, server),
    )


def kill_signals(
    decision: Decision, ttl_seconds: float = DEFAULT_SIGNAL_TTL_SECONDS
) -> list[KillSignal]:
    """The signals a decision sends to its agents (none for a flag).

    A kill of the guard's conversation rules sends two, under the decision's id: its trace's
    (the trace that tripped stops even where its killswitch does not know its conversation)
    and its conversation's, which refuses every later trace of the conversation until the
    decision's `scope_until` (the policy's `conversation.kill_ttl`) or an operator's release.
    A conversation of runs linked to one caller's trace (`linked_conversation`) sends a third:
    the caller's trace's, which stops the agent calling again.
    """
    if decision.action not in ("kill", "downgrade", "pause"):
        return []
    signal = KillSignal.from_decision(decision, ttl_seconds)
    decided = decision.scope
    if (
        signal.scope is not None
        or decided is None
        or decided.kind != "conversation"
        or decision.action != "kill"
    ):
        return [signal]
    scoped = replace(
        signal,
        scope="conversation",
        conversation_id=decided.conversation_id,
        expires_at=decided.until or signal.expires_at,
    )
    caller = caller_trace_of(decided.conversation_id)
    if caller is None or caller == signal.trace_id:
        return [signal, scoped]
    # Runs linked to one caller's trace: the caller is what calls again, stopped by its trace.
    return [signal, scoped, replace(signal, trace_id=caller)]


def linked_conversation(caller_trace_id: str) -> str:
    """The conversation of the agent runs whose traces link to the trace `caller_trace_id`
    (hex), as the guard's conversation scope names it where the runs name none."""
    return LINKED_CONVERSATION_PREFIX + caller_trace_id


def caller_trace_of(conversation_id: str | None) -> str | None:
    """The caller's trace id of a conversation of linked runs (`linked_conversation`), else
    None."""
    if conversation_id is None or not conversation_id.startswith(LINKED_CONVERSATION_PREFIX):
        return None
    caller = conversation_id[len(LINKED_CONVERSATION_PREFIX) :]
    return caller if _TRACE_ID.fullmatch(caller) else None


def canonical_json(record: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the record without `signature`, keys sorted, compact."""
    unsigned = {key: value for key, value in record.items() if key != "signature"}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def key_id(key: bytes) -> str:
    """The id a signed signal names its key by (16 hex chars).

    Derived from the key, so the worker and its agents agree on it with nothing more to
    configure, and an agent given several keys picks the right one: rotation is "agents accept
    old and new, the worker switches, agents drop the old". It is an HMAC of a fixed text, so it
    tells no more about the key than any signature does.
    """
    return hmac.new(key, b"spanguard kill-signal key id", hashlib.sha256).hexdigest()[:16]


def keyring(keys: bytes | str | Iterable[bytes | str]) -> dict[str, bytes]:
    """{key id: key} for one key or several (str keys are UTF-8)."""
    if isinstance(keys, bytes | str):
        keys = [keys]
    ring = {}
    for key in keys:
        raw = key.encode() if isinstance(key, str) else bytes(key)
        if not raw:
            raise ValueError("a signing key must not be empty")
        ring[key_id(raw)] = raw
    return ring


def sign(record: dict[str, Any], key: bytes) -> dict[str, Any]:
    """`record` with its key's `key_id` and an HMAC-SHA256 `signature` (hex) over its
    canonical JSON (the key id included)."""
    named = {**record, "key_id": key_id(key)}
    named.pop("signature", None)
    signature = hmac.new(key, canonical_json(named), hashlib.sha256).hexdigest()
    return {**named, "signature": signature}


SignatureCheck = Literal["valid", "unsigned", "unknown_key", "forged"]


def verify(record: Mapping[str, Any], keys: Mapping[str, bytes]) -> SignatureCheck:
    """How `record`'s signature stands against `keys` ({key id: key}, see `keyring`)."""
    signature = record.get("signature")
    if signature is None:
        return "unsigned"
    key = keys.get(record.get("key_id"))  # type: ignore[arg-type]
    if key is None:
        return "unknown_key"
    if not isinstance(signature, str):
        return "forged"
    expected = hmac.new(key, canonical_json(dict(record)), hashlib.sha256).hexdigest()
    # As bytes: compare_digest refuses str with non-ASCII characters (a forged signature may
    # hold any).
    if hmac.compare_digest(signature.encode("utf-8", "replace"), expected.encode()):
        return "valid"
    return "forged"


def signature_valid(record: Mapping[str, Any], keys: bytes | str | Iterable[bytes | str]) -> bool:
    """Whether `record` carries a signature made with one of `keys` over its other fields."""
    return verify(record, keyring(keys)) == "valid"


def _whole_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    # JSON Schema's regexes are ECMA-262, whose `$` is the end of the text; Python's `$` also
    # matches before a final newline, so "<32 hex>\n" would pass `^[0-9a-f]{32}$`. Matching
    # the whole text gives the ECMA reading.
    if isinstance(instance, str) and re.fullmatch(pattern, instance) is None:
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


# The draft's validator with `pattern` read as a whole-text match. (types-jsonschema leaves
# extend() unannotated.)
_ContractValidator: type[Validator] = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    jsonschema.Draft202012Validator, validators={"pattern": _whole_pattern}
)


@cache
def schema_validator(name: Literal["detection", "kill-signal"]) -> Validator:
    """The validator of one contract's JSON Schema (loaded once)."""
    text = resources.files("spanguard.schemas").joinpath(f"{name}.schema.json").read_text()
    return _ContractValidator(json.loads(text))


def validate(record: dict[str, Any], schema: Literal["detection", "kill-signal"]) -> None:
    """Raise jsonschema.ValidationError when `record` breaks the named contract."""
    schema_validator(schema).validate(record)


# -- reading a kill signal from any bytes ------------------------------------------------

# A signal the worker writes is about 1 kB; anything far larger is not one, and is refused
# before it is decoded.
MAX_SIGNAL_BYTES = 64 * 1024
# A signal nests three levels deep (signal, evidence/agent, values).
MAX_SIGNAL_DEPTH = 8
# How far ahead of the reader's clock a release may be issued (clocks drift a little); one
# issued later than that would outrank every real release of its trace until that time.
MAX_CLOCK_SKEW_SECONDS = 300.0


class BadSignal(Exception):
    """A record on the kill-signal topic that is not a signal this agent may act on."""

    def __init__(self, kind: str, detail: str) -> None:
        # The detail quotes attacker-controlled text: keep it short and printable.
        detail = detail if len(detail) <= 200 else detail[:200] + "..."
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail.encode("unicode_escape").decode("ascii")


def read_signal(
    value: bytes | None, keys: Mapping[str, bytes] | None, now: datetime | None = None
) -> KillSignal:
    """The kill signal in `value`, or BadSignal saying why not. Any bytes are safe here.

    `keys` ({key id: key}, see `keyring`) are the keys a signal must be signed with; None
    obeys unsigned signals. `now` (default: the current time) decides expiry."""
    if not value:
        raise BadSignal("empty", "no value")
    if len(value) > MAX_SIGNAL_BYTES:
        raise BadSignal("too_large", f"{len(value)} bytes (at most {MAX_SIGNAL_BYTES})")
    try:
        text = bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadSignal("not_utf8", str(exc)) from None
    try:
        record = json.loads(
            text,
            parse_constant=_refuse_constant,
            parse_float=_refuse_unsafe_number,
            parse_int=_safe_integer,
            object_pairs_hook=_unique_keys,
        )
    except RecursionError:
        raise BadSignal("too_deep", "nested too deeply to decode") from None
    except _UnsafeNumber as exc:
        raise BadSignal("invalid", str(exc)) from None
    except ValueError as exc:  # duplicate keys included: parsers disagree on which one counts
        raise BadSignal("not_json", str(exc)) from None
    if not isinstance(record, dict):
        raise BadSignal("not_object", f"a JSON {type(record).__name__}, not an object")
    if _depth(record) > MAX_SIGNAL_DEPTH:
        raise BadSignal("too_deep", f"nested more than {MAX_SIGNAL_DEPTH} levels")
    try:
        canonical_json(record)  # what a signature covers must be UTF-8 text
    except UnicodeEncodeError:
        raise BadSignal("not_utf8", "a string holds a lone surrogate escape") from None
    error = jsonschema.exceptions.best_match(schema_validator("kill-signal").iter_errors(record))
    if error is not None:
        where = ".".join(str(part) for part in error.absolute_path) or "(top level)"
        raise BadSignal("invalid", f"field {where}: {error.message}")
    if keys is not None:
        check = verify(record, keys)
        if check != "valid":
            detail = f"signal for trace {record['trace_id']}"
            if check == "unknown_key":
                detail += f", signed with key id {record['key_id']}, not one of this agent's"
            raise BadSignal(check, detail)
    signal = KillSignal.from_dict(record)
    times = {}
    for name in (
        "detected_at",
        "expires_at",
        *(("pause_until",) if signal.kind == "pause" else ()),
    ):
        try:  # the pattern lets through a date that does not exist
            times[name] = datetime.fromisoformat(record[name])
        except ValueError as exc:
            raise BadSignal("invalid", f"field {name}: {exc}") from None
    now = now or datetime.now(UTC)
    if now >= times["expires_at"]:
        raise BadSignal(
            "expired", f"signal for {signal.describe_target()} expired at {signal.expires_at}"
        )
    if (
        signal.kind == "release"
        and (times["detected_at"] - now).total_seconds() > MAX_CLOCK_SKEW_SECONDS
    ):
        raise BadSignal(
            "invalid",
            f"field detected_at: release of trace {signal.trace_id} issued at {signal.detected_at}, more than"
            f" {MAX_CLOCK_SKEW_SECONDS:g} s ahead of {now.isoformat(timespec='seconds')}",
        )
    return signal


class _DuplicateKey(ValueError):
    pass


# The integers every language's JSON numbers hold exactly: a signal is read alike by the
# Python, TypeScript and Go killswitches (schemas/testdata/kill-signal-vectors.json).
MAX_SAFE_INTEGER = 2**53 - 1


class _UnsafeNumber(Exception):  # not a ValueError: it is `invalid`, not `not_json`
    pass


def _refuse_unsafe_number(literal: str) -> NoReturn:
    raise _UnsafeNumber(f"the number {literal[:40]} is not an integer within +-(2**53 - 1)")


def _safe_integer(literal: str) -> int:
    # Past 17 characters (a sign and 16 digits) it cannot be safe: refused before int() reads it.
    value = int(literal) if len(literal) <= 17 else None
    if value is None or abs(value) > MAX_SAFE_INTEGER:
        _refuse_unsafe_number(literal)
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # With a key given twice, parsers disagree on which one counts (Python's: the last): the
    # same signed bytes could mean another kind to another reader.
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(f"key {key!r} appears twice in one object")
            seen.add(key)
    return record


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _depth(document: Any) -> int:
    """How deeply containers nest in `document`, without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_SIGNAL_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest
