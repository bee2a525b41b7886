"""The agent scope over time: tokens and dollars per agent over a rolling window, across all of
its traces.

A weekend of spend is made of runs that each look fine alone: a thousand short traces under
every trace budget. The trace guard (guard.py) hands each change of a trace's usage to the agent
usage sink (`AgentUsageSink`: an AgentBudgetGuard, or the worker's recorder), which an
AgentBudgetGuard counts as a compact record (`AgentUsage`: the agent, the trace, the span's end
time, token and cost deltas), and the policy entry matching the agent (`agent_budget: {window,
tokens, usd, action}`) says what the agent may spend per window. Pure Python, no I/O.

Time is record time (the spans' end times), so replay decides what a live run decided. State
is bounded: per agent at most MAX_BUCKETS buckets of counts (a minute each for a window of up
to 4 hours, wider for longer ones), and at most `max_agents` agents, the least recently seen
forgotten first. A clock that jumps costs the agent's own window only:
- a span that ended before the newest bucket (late, or a clock set back) within the window is
  counted into the newest bucket (`late`);
- a span a whole window or more before or after the newest bucket (a clock far off either way)
  starts the window afresh from it (`resets`): one bad clock cannot pin the window in the
  future or the past.

Crossing a budget is a decision like any other (flag: recorded and notified); with
`action: kill`, a kill of the agent's scope (every trace of the agent, see KillSignal.scope)
that expires when the window frees: when enough of the oldest buckets leave it that the
agent is back under budget. One decision per crossing: the next comes after that time.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from spanguard.detection.pricing import micro_usd, pico_usd
from spanguard.detection.rules.base import FLAG
from spanguard.detection.scope import ScopeGuard
from spanguard.detection.trace_state import encode_record
from spanguard.schemas.decision import Decision, Rule, ScopeKind, Spend
from spanguard.schemas.policy import AgentPolicy, Policy

__all__ = [
    "DEFAULT_MAX_AGENTS",
    "MAX_BUCKETS",
    "AgentBudgetGuard",
    "AgentUsage",
    "AgentUsageSink",
    "AgentWindow",
    "bucket_seconds",
    "has_agent_budget",
]

SCOPE: ScopeKind = "agent"
RULE: Rule = "agent_budget"
WINDOW_VERSION = 1
# Sources (Kafka topic partitions) a window remembers the last record of, at most.
MAX_SOURCES = 512
# Buckets per window at most: a minute each up to a 4-hour window, then wider.
MAX_BUCKETS = 240
MIN_BUCKET_SECONDS = 60
DEFAULT_MAX_AGENTS = 10_000


def bucket_seconds(window: int) -> int:
    """How wide one bucket of a `window`-second window is (whole seconds, the window a whole
    number of them, rounded up)."""
    return max(MIN_BUCKET_SECONDS, -(-window // MAX_BUCKETS))


@dataclass(slots=True)
class AgentUsage:
    """What one usage span added to its trace's tokens and cost, with the agent it belongs to."""

    service: str
    agent_name: str | None
    trace_id: str
    span_id: bytes
    end_time_unix_nano: int
    tokens: int
    cost: int  # pico-dollars; 0 when usage is not priced


@dataclass(slots=True)
class AgentWindow:
    """One agent's spend over its rolling window: [bucket index, tokens, cost] oldest first.

    Kept in memory (replay, in-process mode) or as `to_bytes()` in the worker's agent window
    table (streams/agent_windows.py), where `last_seen` (wall clock) lets idle ones be
    evicted and `sources` drops the records a worker sent twice."""

    buckets: deque[list[int]] = field(default_factory=deque)
    tokens: int = 0
    cost: int = 0  # pico-dollars
    # Until when (epoch seconds, record time) the last crossing holds: no new decision before.
    tripped_until: float = 0.0
    late: int = 0  # spans counted into the newest bucket though they ended before it
    resets: int = 0  # windows started afresh by a span a whole window away
    # Where the records counted came from: "topic:partition" -> the offset of the last one
    # (bounded by MAX_SOURCES, the oldest dropped first); empty outside the worker.
    sources: dict[str, int] = field(default_factory=dict)
    last_seen: float = 0.0  # wall clock of the last change

    def to_dict(self) -> dict[str, Any]:
        """`last_seen` last: the worker's eviction reads it without decoding the rest."""
        return {
            "v": WINDOW_VERSION,
            "buckets": [list(bucket) for bucket in self.buckets],
            "tokens": self.tokens,
            "cost": self.cost,
            "tripped_until": self.tripped_until,
            "late": self.late,
            "resets": self.resets,
            "sources": self.sources,
            "last_seen": self.last_seen,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> AgentWindow:
        return cls(
            buckets=deque([int(i), int(t), int(c)] for i, t, c in record["buckets"]),
            tokens=int(record["tokens"]),
            cost=int(record["cost"]),
            tripped_until=float(record["tripped_until"]),
            late=int(record.get("late", 0)),
            resets=int(record.get("resets", 0)),
            sources={str(k): int(v) for k, v in record.get("sources", {}).items()},
            last_seen=float(record.get("last_seen", 0.0)),
        )

    def to_bytes(self) -> bytes:
        return encode_record(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> AgentWindow:
        return cls.from_dict(json.loads(data))


class AgentUsageSink(Protocol):
    """Where the trace guard hands each change of a trace's usage (field by field: the worker's
    recorder sums them without a record per span): an AgentBudgetGuard decides on it, the
    worker's recorder sends it to the agent usage topic (streams/agent_windows.py)."""

    def hand_spend(
        self,
        service: str,
        agent_name: str | None,
        trace_id: str,
        span_id: bytes,
        ended: int,
        tokens: int,
        cost: int,
    ) -> None: ...


class AgentBudgetGuard(ScopeGuard):
    """Keeps each agent's rolling window and decides when one crosses its budget.

    An agent usage sink: `Guard(agent_budgets=AgentBudgetGuard(policy))` feeds it every change
    of a trace's usage and returns its decisions with its own; `observe_usage` may also be fed
    directly.
    `windows` maps (service, agent name) to AgentWindow: in memory by default (the least
    recently seen of more than `max_agents` forgotten), or the worker's table, whose idle
    windows the worker evicts. A changed window is written back to it once per record."""

    def __init__(
        self,
        policy: Policy,
        *,
        clock: Callable[[], float] = time.time,
        max_agents: int = DEFAULT_MAX_AGENTS,
        windows: MutableMapping[tuple[str, str | None], AgentWindow] | None = None,
    ) -> None:
        super().__init__(policy, SCOPE, clock)
        self.max_agents = max_agents
        self.windows: MutableMapping[tuple[str, str | None], AgentWindow] = (
            OrderedDict() if windows is None else windows
        )
        self.forgotten = 0  # agents pushed out by `max_agents`

    @property
    def enabled(self) -> bool:
        policies = self.policy.entries
        return any(has_agent_budget(policy) for policy in policies)

    @property
    def prices_usage(self) -> bool:
        policies = self.policy.entries
        return any(policy.agent_budget.usd is not None for policy in policies)

    def hand_spend(
        self,
        service: str,
        agent_name: str | None,
        trace_id: str,
        span_id: bytes,
        ended: int,
        tokens: int,
        cost: int,
    ) -> None:
        """What one usage span added to its trace, as the guard hands it on (observe_usage's
        fields one by one: the worker's recorder sums them without a record per span)."""
        self.observe_usage(AgentUsage(service, agent_name, trace_id, span_id, ended, tokens, cost))

    def observe_usage(self, record: AgentUsage) -> Decision | None:
        policy = self.policy_of(record.service, record.agent_name)
        if not has_agent_budget(policy) or (record.tokens <= 0 and record.cost <= 0):
            return None
        window_seconds = policy.agent_budget.window
        width = bucket_seconds(window_seconds)
        span = -(-window_seconds // width)  # buckets in the window
        ended = record.end_time_unix_nano / 1e9 if record.end_time_unix_nano > 0 else self.clock()
        index = int(ended // width)
        key = (record.service, record.agent_name)
        window = self._window(key)
        if window.buckets:
            newest = window.buckets[-1][0]
            if abs(index - newest) >= span:
                self._reset(window, key, index, newest)
            elif index < newest:
                window.late += 1
                index = newest
        while window.buckets and window.buckets[0][0] <= index - span:
            _, tokens, cost = window.buckets.popleft()
            window.tokens -= tokens
            window.cost -= cost
        if window.buckets and window.buckets[-1][0] == index:
            bucket = window.buckets[-1]
            bucket[1] += record.tokens
            bucket[2] += record.cost
        else:
            window.buckets.append([index, record.tokens, record.cost])
        window.tokens += record.tokens
        window.cost += record.cost
        window.last_seen = self.clock()
        decision = None
        if ended >= window.tripped_until:  # else decided; the next after the window frees
            decision = self._crossed(window, record, policy, width, span)
        self.windows[key] = window  # a table's copy is not the window changed in place
        if decision is not None:
            self.pending.append(decision)
        return decision

    def retract(self, decision: Decision) -> None:
        """Undo the mark of a decision whose signal could not be sent: it may trip again."""
        key = (decision.agent.service, decision.agent.name)
        window = self.windows.get(key)
        if window is not None:
            window.tripped_until = 0.0
            self.windows[key] = window

    # -- helpers -----------------------------------------------------------------------------

    def _crossed(
        self,
        window: AgentWindow,
        record: AgentUsage,
        policy: AgentPolicy,
        width: int,
        span: int,
    ) -> Decision | None:
        token_budget = policy.agent_budget.tokens
        cost_budget = pico_usd(policy.agent_budget.usd) if policy.agent_budget.usd else None
        over_tokens = token_budget is not None and window.tokens > token_budget
        over_cost = cost_budget is not None and window.cost > cost_budget
        if not (over_tokens or over_cost):
            return None
        # When the window frees: the oldest buckets leave it, one by one, until the agent is
        # back within every budget it crossed.
        tokens, cost = window.tokens, window.cost
        frees_at = (window.buckets[-1][0] + span) * width
        for index, bucket_tokens, bucket_cost in window.buckets:
            tokens -= bucket_tokens
            cost -= bucket_cost
            if (token_budget is None or tokens <= token_budget) and (
                cost_budget is None or cost <= cost_budget
            ):
                frees_at = (index + span) * width
                break
        window.tripped_until = float(frees_at)
        agent = _agent_text(record.service, record.agent_name)
        period = _period(policy.agent_budget.window)
        if over_tokens:
            reason = (
                f"agent {agent} used {window.tokens} tokens in the last {period}, over its"
                f" budget of {token_budget}"
            )
        else:
            reason = (
                f"agent {agent} spent ${window.cost / 1e12:.4f} in the last {period}, over its"
                f" budget of ${policy.agent_budget.usd:g}"
            )
        action = FLAG if policy.shadow else policy.agent_budget.action
        until = datetime.fromtimestamp(frees_at, UTC).isoformat(timespec="milliseconds")
        # Deterministic: the same crossing replayed carries the same id.
        text = f"agent:{record.service}/{record.agent_name or ''}:{RULE}:{action}:{frees_at}"
        return self.scope_decision(
            record,
            policy,
            RULE,
            action,
            f"{reason}; the window frees at {until}",
            text,
            spend=Spend(
                tokens=window.tokens,
                token_budget=token_budget,
                cost_micro_usd=micro_usd(window.cost) if cost_budget is not None else None,
                budget_micro_usd=micro_usd(cost_budget) if cost_budget is not None else None,
            ),
            until=until if action == "kill" else None,
        )

    def _window(self, key: tuple[str, str | None]) -> AgentWindow:
        window = self.windows.get(key)
        windows = self.windows
        if not isinstance(windows, OrderedDict):  # the worker's table: bounded by eviction
            return window if window is not None else AgentWindow()
        if window is not None:
            windows.move_to_end(key)
            return window
        window = windows[key] = AgentWindow()
        if len(windows) > self.max_agents:
            windows.popitem(last=False)
            self.forgotten += 1
            self.tell_once(
                "forgotten",
                "agent budgets: more than %d agents; the least recently seen is forgotten"
                " (counted in AgentBudgetGuard.forgotten)",
                self.max_agents,
            )
        return window

    def _reset(
        self, window: AgentWindow, key: tuple[str, str | None], index: int, newest: int
    ) -> None:
        window.buckets.clear()
        window.tokens = window.cost = 0
        window.tripped_until = 0.0
        window.resets += 1
        self.tell_once(
            f"reset:{key}",
            "agent budget of %s: a span ended a whole window away from the newest one (bucket"
            " %d, newest %d): its window starts afresh (counted in AgentWindow.resets)",
            _agent_text(*key),
            index,
            newest,
        )


def has_agent_budget(policy: AgentPolicy) -> bool:
    """Whether a policy entry sets an agent budget (tokens or dollars per window)."""
    return policy.agent_budget.tokens is not None or policy.agent_budget.usd is not None


def _agent_text(service: str, agent_name: str | None) -> str:
    return f"{service}/{agent_name}" if agent_name else service


def _period(seconds: int) -> str:
    if seconds % 86400 == 0:
        return "day" if seconds == 86400 else f"{seconds // 86400} days"
    if seconds % 3600 == 0:
        return "hour" if seconds == 3600 else f"{seconds // 3600} hours"
    return f"{seconds} s"
