"""The conversation scope: the calls and usage of all the traces of one conversation, in the
order the guard reads them, under the loop and cycle rules and the conversation's budgets.

Many frameworks start a trace per turn or per run (a chat app per user message, the OpenAI
Agents SDK's `Runner.run`, a scheduler's retries): six traces each searching "refund policy"
twice are twelve identical calls that no trace alone counts to 4. The trace guard (guard.py)
hands each counted call and each change of a trace's usage to the conversation sink
(`ConversationSink`: a ConversationGuard, or the worker's recorder) as a compact
record (`ConversationCall`, `ConversationUsage`: ids, the call's key and times, token and cost
deltas; never arguments), keyed by the conversation id the trace's spans name, or, for an agent
run whose trace links to its caller's and names none, `trace:<the caller's trace id>` (the runs
one caller started, each in a trace of its own, are one conversation). Pure Python, no
I/O: replay and tests run it beside the guard with a dict for state; the worker feeds it
from a repartition of these records by conversation id (streams/conversations.py).

What it decides (docs/design.md has why):
- a tool_loop or cycle whose evidence spans two traces or more: the policy's
  `conversation.action`, `flag` by default (the user asking twice is not the agent looping);
  one within a single trace is the trace's own rules' business and is left to them;
- `conversation.token_budget` / `conversation.usd_budget` crossed: the trace that spent past it
  is killed (a flag in shadow mode), and so is every later trace of the conversation that
  spends, once each: the conversation's money is spent.

A kill names the conversation and `scope_until` (`conversation.kill_ttl` after it): its signals
stop the trace that tripped and, for that long, every later trace of the conversation
(schemas/decision.py, `kill_signals`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from itertools import islice
from typing import Any, Protocol

from mypy_extensions import mypyc_attr

from spanguard.detection.conventions.events import ToolCall
from spanguard.detection.pricing import micro_usd, pico_usd
from spanguard.detection.rules import CYCLE, TOOL_LOOP
from spanguard.detection.rules.base import FLAG, KILL, Fired, Trip
from spanguard.detection.rules.cycle import Cycle
from spanguard.detection.rules.tool_loop import ToolLoop
from spanguard.detection.scope import ScopeGuard
from spanguard.detection.trace_state import CallKey, TraceState, call_mark, trim_window
from spanguard.schemas.decision import Decision, ScopeKind, Spend
from spanguard.schemas.policy import AgentPolicy, Policy

__all__ = [
    "MAX_TRACES_REMEMBERED",
    "ConversationCall",
    "ConversationGuard",
    "ConversationSink",
    "ConversationState",
    "ConversationUsage",
]

log = logging.getLogger("spanguard.core")

# Trace ids a conversation remembers (to count its traces, and which were killed for its
# budget): bounded, so a conversation shared by thousands of traces costs the same memory.
MAX_TRACES_REMEMBERED = 256
SCOPE: ScopeKind = "conversation"


# Made per call and per usage change, on both sides of the conversation topic: their
# `__init__` is written out, so that the compiled core compiles it (docs/hot-path.md).
@mypyc_attr(acyclic=True)
@dataclass(slots=True, init=False)
class ConversationCall:
    """One counted tool call, as the conversation scope needs it (what the worker
    repartitions by `conversation_id`)."""

    conversation_id: str
    trace_id: str
    span_id: bytes
    end_time_unix_nano: int
    key: CallKey
    service: str
    agent_name: str | None

    def __init__(
        self,
        conversation_id: str,
        trace_id: str,
        span_id: bytes,
        end_time_unix_nano: int,
        key: CallKey,
        service: str,
        agent_name: str | None,
    ) -> None:
        self.conversation_id = conversation_id
        self.trace_id = trace_id
        self.span_id = span_id
        self.end_time_unix_nano = end_time_unix_nano
        self.key = key
        self.service = service
        self.agent_name = agent_name


@mypyc_attr(acyclic=True)
@dataclass(slots=True, init=False)
class ConversationUsage:
    """What one usage span added to its trace's tokens and cost (deltas, so a conversation
    sums traces without counting an agent's aggregate twice)."""

    conversation_id: str
    trace_id: str
    span_id: bytes
    end_time_unix_nano: int
    tokens: int
    cost: int  # pico-dollars; 0 when usage is not priced
    service: str
    agent_name: str | None

    def __init__(
        self,
        conversation_id: str,
        trace_id: str,
        span_id: bytes,
        end_time_unix_nano: int,
        tokens: int,
        cost: int,
        service: str,
        agent_name: str | None,
    ) -> None:
        self.conversation_id = conversation_id
        self.trace_id = trace_id
        self.span_id = span_id
        self.end_time_unix_nano = end_time_unix_nano
        self.tokens = tokens
        self.cost = cost
        self.service = service
        self.agent_name = agent_name


class ConversationSink(Protocol):
    """Where the trace guard hands the records of the traces that name a conversation: a
    ConversationGuard decides them, the worker's recorder sends them to the conversation topic
    (streams/conversations.py)."""

    # Whether the guard hands it usage changes at all (only where some policy entry wants them).
    counts_usage: bool

    def hand_call(self, record: ConversationCall) -> None: ...

    def hand_usage(self, record: ConversationUsage) -> None: ...


@dataclass(slots=True)
class ConversationState(TraceState):
    """A TraceState over the conversation's calls (the rules read it as they read a trace's),
    with which trace each call of the window came from. Kept in memory (replay, in-process
    mode) or as `to_bytes()` in the worker's conversation table (streams/conversations.py)."""

    window_traces: deque[str] = field(default_factory=deque)  # aligned with `window`
    traces: OrderedDict[str, None] = field(default_factory=OrderedDict)  # last seen, bounded
    trace_count: int = 0  # every trace seen, beyond what `traces` remembers
    # "rule:trace id" of the traces a kill of the scope stopped (bounded): one kill per trace
    # and rule, as in the trace scope.
    killed: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def restart_window(self) -> None:
        TraceState.restart_window(self)
        self.window_traces.clear()

    def to_dict(self) -> dict[str, Any]:
        """The trace state's record and the conversation's own fields, `last_seen` still last
        (the worker's eviction reads it without decoding)."""
        record = TraceState.to_dict(self)
        last_seen = record.pop("last_seen")
        record["window_traces"] = list(self.window_traces)
        record["traces"] = list(self.traces)
        record["trace_count"] = self.trace_count
        record["killed"] = list(self.killed)
        record["last_seen"] = last_seen
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> ConversationState:
        # (mypy does not know a classmethod's __func__: the call gives a `cls`, as annotated.)
        state: ConversationState = TraceState.from_dict.__func__(cls, record)  # type: ignore[attr-defined]
        state.window_traces = deque(record.get("window_traces", ()))
        state.traces = OrderedDict.fromkeys(record.get("traces", ()))
        state.trace_count = record.get("trace_count", len(state.traces))
        state.killed = OrderedDict.fromkeys(record.get("killed", ()))
        return state


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one policy entry asks of the conversation scope's call rules."""

    policy: AgentPolicy
    rules: tuple[ToolLoop | Cycle, ...]  # the call rules it turns on, tool_loop first
    action: str  # what a repeat across traces does: flag in shadow mode, else the policy's
    cycle_enabled: bool
    history: int  # the calls the conversation's window keeps


@mypyc_attr(allow_interpreted_subclasses=True)  # the worker's table extends it
class ConversationGuard(ScopeGuard):
    """Runs tool_loop and cycle, and the conversation budgets, per conversation.

    A conversation sink: `Guard(conversations=ConversationGuard(policy))` hands it every counted
    call and usage change of traces that name a conversation, and returns its decisions with
    its own. `states` maps conversation id to ConversationState (a dict by default).
    """

    def __init__(
        self,
        policy: Policy,
        *,
        states: MutableMapping[str, ConversationState] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(policy, SCOPE, clock)
        self.states: MutableMapping[str, ConversationState] = {} if states is None else states
        # Whether the guard hands this scope the changes of its traces' usage: only where some
        # policy entry turns the scope on.
        self.counts_usage = any(entry.conversation.enabled for entry in policy.entries)
        self.calls = 0
        self._plans: dict[int, _Plan] = {}

    # -- fed by the guard --------------------------------------------------------------------

    def hand_call(self, record: ConversationCall) -> None:
        decision = self.observe_call(record)
        if decision is not None:
            self.pending.append(decision)

    def hand_usage(self, record: ConversationUsage) -> None:
        decision = self.observe_usage(record)
        if decision is not None:
            self.pending.append(decision)

    def observe_call(self, record: ConversationCall) -> Decision | None:
        policy = self.policy_of(record.service, record.agent_name)
        if not policy.conversation.enabled:
            return None
        self.calls += 1
        plan = self._plans.get(id(policy))
        if plan is None or plan.policy is not policy:
            plan = self._plan(policy)
        state = self._state(record.conversation_id, record.service, record.agent_name)
        self._seen_trace(state, record.trace_id)
        key = record.key
        if plan.cycle_enabled and key[1] is not None:
            CYCLE.count(state, _NO_CALL, key, policy)
        elif plan.cycle_enabled:
            state.cycle_runs = None
        self._slide(state, record, plan.history)
        decision = None
        action = plan.action
        for rule in plan.rules:
            if action == FLAG and rule.flagged in state.fired:
                continue  # flagged once per conversation
            if action == KILL and f"{rule.name}:{record.trace_id}" in state.killed:
                continue
            trip = rule.check(state, _NO_CALL, key, policy)
            if trip is None or trip.flag_only:
                continue
            traces = self._traces_in(state, trip)
            if traces < 2:
                continue  # within one trace: the trace's own rules decide
            decision = self._fire(rule.name, action, trip, traces, record, state, policy)
            if action == KILL:
                _remember(state.killed, f"{rule.name}:{record.trace_id}")
                state.restart_window()  # another kill needs a repeat of its own
            break
        state.window.memo = None  # the key's entry, packed for the rules: not kept
        self._store(record, state)
        return decision

    def observe_usage(self, record: ConversationUsage) -> Decision | None:
        policy = self.policy_of(record.service, record.agent_name)
        if not policy.conversation.enabled:
            return None
        state = self._state(record.conversation_id, record.service, record.agent_name)
        self._seen_trace(state, record.trace_id)
        state.inference_tokens = (state.inference_tokens or 0) + record.tokens
        if record.cost:
            state.inference_cost = (state.inference_cost or 0) + record.cost
        state.last_seen = self.clock()
        decision = None
        trip, rule = self._over_budget(state, policy)
        if trip is not None and f"{rule}:{record.trace_id}" not in state.killed:
            action = FLAG if policy.shadow else KILL
            decision = self._fire(rule, action, trip, state.trace_count, record, state, policy)
            _remember(state.killed, f"{rule}:{record.trace_id}")
        self._store(record, state)
        return decision

    def retract(self, decision: Decision) -> None:
        """Undo the mark of a decision of this scope whose signal could not be sent."""
        scope = decision.scope
        conversation_id = (scope.conversation_id if scope is not None else None) or ""
        state = self.states.get(conversation_id)
        if state is None:
            return
        state.fired.discard(Fired(decision.rule, decision.action))
        state.killed.pop(f"{decision.rule}:{decision.trace_id}", None)
        self.states[conversation_id] = state

    def evict_idle(self, ttl_seconds: float) -> int:
        """Forget conversations not seen for `ttl_seconds`; return how many."""
        cutoff = self.clock() - ttl_seconds
        idle = [cid for cid, state in self.states.items() if state.last_seen < cutoff]
        for cid in idle:
            del self.states[cid]
        return len(idle)

    # -- helpers -----------------------------------------------------------------------------

    def _plan(self, policy: AgentPolicy) -> _Plan:
        """What `policy` asks of the scope's call rules, worked out once per policy entry (not
        per call); keyed by id (a policy hashes slowly), with the policy kept to check it."""
        rules = tuple(rule for rule in (TOOL_LOOP, CYCLE) if rule.wanted(policy) != "off")
        action = FLAG if policy.shadow else policy.conversation.action
        plan = _Plan(policy, rules, action, policy.cycle.enabled, policy.history)
        self._plans[id(policy)] = plan
        return plan

    def _state(self, conversation_id: str, service: str, agent_name: str | None) -> Any:
        state = self.states.get(conversation_id)
        if state is None:
            state = ConversationState(service, agent_name)
        return state

    def _store(self, record: ConversationCall | ConversationUsage, state: Any) -> None:
        """Write the state a record changed back (the worker's scope remembers the record's
        span id there too)."""
        self.states[record.conversation_id] = state

    @staticmethod
    def _seen_trace(state: ConversationState, trace_id: str) -> None:
        if trace_id in state.traces:
            state.traces.move_to_end(trace_id)
            return
        state.traces[trace_id] = None
        state.trace_count += 1
        if len(state.traces) > MAX_TRACES_REMEMBERED:
            state.traces.popitem(last=False)

    def _slide(self, state: ConversationState, record: ConversationCall, size: int) -> None:
        state.window.append(record.key)
        state.window_traces.append(record.trace_id)
        state.window_marks += call_mark(record.span_id, record.end_time_unix_nano)
        while len(state.window_traces) > size:
            state.window_traces.popleft()
        trim_window(state, size)
        state.last_seen = self.clock()

    @staticmethod
    def _traces_in(state: ConversationState, trip: Trip) -> int:
        """How many traces the trip's evidence spans: the repeated call's (tool_loop), or the
        calls of the repeated rounds (cycle)."""
        steps = min(trip.evidence.steps or len(state.window), len(state.window))
        keys = state.window.newest_first(steps)
        traces = list(islice(reversed(state.window_traces), steps))
        if trip.evidence.period is None:  # tool_loop: the traces of the repeated key
            repeated = state.window[-1]
            return len({trace for key, trace in zip(keys, traces, strict=True) if key == repeated})
        return len(set(traces))

    def _over_budget(
        self, state: ConversationState, policy: AgentPolicy
    ) -> tuple[Trip | None, str]:
        tokens = state.inference_tokens or 0
        budget = policy.conversation.token_budget
        if budget is not None and tokens > budget:
            return Trip(
                f"the conversation's {state.trace_count} traces used {tokens} tokens, over its"
                f" budget of {budget}",
                spend=Spend(tokens=tokens, token_budget=budget),
            ), "token_budget"
        usd = policy.conversation.usd_budget
        cost = state.inference_cost or 0
        if usd is not None and cost > pico_usd(usd):
            return Trip(
                f"the conversation's {state.trace_count} traces spent ${cost / 1e12:.4f}, over"
                f" its budget of ${usd:g}",
                spend=Spend(
                    tokens=tokens,
                    cost_micro_usd=micro_usd(cost),
                    budget_micro_usd=micro_usd(pico_usd(usd)),
                ),
            ), "cost_budget"
        return None, ""

    def _fire(
        self,
        rule: str,
        action: str,
        trip: Trip,
        traces: int,
        record: ConversationCall | ConversationUsage,
        state: ConversationState,
        policy: AgentPolicy,
    ) -> Decision:
        state.fired.add(Fired(rule, action))
        calls = trip.evidence.calls
        evidence = replace(
            trip.evidence,
            calls=None if calls is None else self._window_calls(state, len(calls)),
            tool_arguments=None,  # raw arguments never leave the trace scope
        )
        # Deterministic, and apart from the trace scope's ids: the same conversation decision
        # replayed after a crash carries the same id. A budget kill is one per trace.
        text = f"conversation:{record.conversation_id}:{rule}:{action}"
        if action == KILL:  # one per trace and rule
            text += f":{record.trace_id}"
        detected = datetime.fromtimestamp(self.clock(), UTC)
        # A kill also refuses the conversation's later traces, until `kill_ttl` after it.
        until = detected + timedelta(seconds=policy.conversation.kill_ttl)
        return self.scope_decision(
            record,
            policy,
            rule,
            action,
            f"{trip.reason} (conversation {record.conversation_id}, {traces} traces)",
            text,
            detected,
            evidence=evidence,
            spend=trip.spend,
            conversation_id=record.conversation_id,
            traces=traces,
            until=until.isoformat(timespec="milliseconds") if action == KILL else None,
        )

    @staticmethod
    def _window_calls(state: ConversationState, last: int) -> list[dict[str, Any]]:
        return state.window_calls(last)


def _remember(seen: OrderedDict[str, None], key: str) -> None:
    seen[key] = None
    if len(seen) > MAX_TRACES_REMEMBERED:
        seen.popitem(last=False)


# The rules' `call` argument: the conversation scope keeps no raw call (nor its arguments). A
# real ToolCall, as the compiled rules check the type of what they are given.
_NO_CALL = ToolCall(
    span_id=b"", tool_name="", arguments=None, call_id=None, agent_name=None, match_attributes=None
)
