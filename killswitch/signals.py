"""The agent side of a kill signal: a book of what each trace was told, and `AgentKilled`.

Both ways a signal can reach an agent process feed the same `SignalBook`: the in-process
`GuardingSpanProcessor` delivers its own decisions, and the Kafka `KillSwitch` delivers what it
reads from `agent-kill-signals`. The agent calls `check()` before each tool call; a signal that
arrived in between is never lost, because it is recorded here rather than raised at delivery.

Delivery and checks come from any thread (a consumer thread, the SDK's span-ending thread, the
agent's threads) and from asyncio code: the book takes a plain `threading.Lock` for a few dict
operations and never blocks on I/O, so a check from an event loop costs microseconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, NoReturn

from spanguard.killswitch.stop import record_on_current_span
from spanguard.schemas.decision import AgentIdentity, KillSignal, ToolIdentity

__all__ = [
    "DEFAULT_MAX_TRACES",
    "AgentKilled",
    "AgentPaused",
    "SignalBook",
    "ToolContained",
    "agent_of",
    "current_agent",
    "current_conversation_id",
    "current_trace_id",
]

DEFAULT_MAX_TRACES = 10_000

log = logging.getLogger("spanguard.killswitch")


class AgentKilled(Exception):
    """Raised by `check()` in an agent whose trace was killed; carries the signal, and what a
    parent process or a log wants of it: `rule`, `action`, `decision_id`, `scope`, `reason`
    (the attributes of the `spanguard.stop` span event; killswitch/stop.py)."""

    def __init__(self, signal: KillSignal) -> None:
        super().__init__(f"spanguard killed {signal.describe_target()}: {signal.reason}")
        self.signal = signal
        self.trace_id = signal.trace_id
        self.reason = signal.reason
        self.scope = signal.stops  # "trace", "conversation" or "agent"
        self.rule = str(signal.rule)
        self.action = str(signal.kind)  # "kill" (a pause past its deadline: its fallback's kill)
        self.decision_id = signal.signal_id

    def __reduce__(self) -> tuple[type[AgentKilled], tuple[KillSignal]]:
        # The default reduce would call AgentKilled(message): keep it picklable (multiprocessing).
        return (type(self), (self.signal,))


class ToolContained(AgentKilled):
    """Raised by a check naming a tool that spanguard has contained (a signal of scope tool):
    the call to that tool is refused, not the agent. A subclass of AgentKilled, so code that
    catches only AgentKilled still stops; the adapters instead hand the model this message as
    the tool's error, so the agent can take another path. `tool` and `server` name it."""

    def __init__(self, signal: KillSignal) -> None:
        tool = signal.tool or ToolIdentity(str(signal.evidence.get("tool_name", "")))
        Exception.__init__(
            self,
            f"tool {tool.name} is contained by spanguard: {signal.reason}; use another tool",
        )
        self.signal = signal
        self.trace_id = signal.trace_id
        self.reason = signal.reason
        self.scope = "tool"
        self.rule = str(signal.rule)
        self.action = "contain"
        self.decision_id = signal.signal_id
        self.tool = tool.name
        self.server = tool.server

    def __reduce__(self) -> tuple[type[ToolContained], tuple[KillSignal]]:
        return (type(self), (self.signal,))


class AgentPaused(Exception):
    """Raised by `check()` in an agent whose trace is paused: it must wait for an operator's
    `spanguard release` (go on) or `spanguard kill` (stop), or until `until`, when the policy's
    `fallback` applies. `wait()` (SignalBook, KillSwitch, the adapters) does the waiting."""

    def __init__(self, signal: KillSignal) -> None:
        super().__init__(
            f"spanguard paused trace {signal.trace_id}: {signal.reason}; waiting for"
            f" `spanguard release` or `spanguard kill` until {signal.pause_until},"
            f" then {signal.pause_fallback}"
        )
        self.signal = signal
        self.trace_id = signal.trace_id
        self.reason = signal.reason
        self.until = signal.pause_until
        self.fallback = signal.pause_fallback
        self.scope = signal.stops
        self.rule = str(signal.rule)
        self.action = "pause"
        self.decision_id = signal.signal_id

    def __reduce__(self) -> tuple[type[AgentPaused], tuple[KillSignal]]:
        return (type(self), (self.signal,))


@dataclass(slots=True)
class _TraceSignals:
    """What one trace has been told, and what its agent has not read yet."""

    signal_ids: set[str] = field(default_factory=set)
    kill: KillSignal | None = None
    # A downgrade's message with its signal (the span event names the decision).
    unread_messages: deque[tuple[str, KillSignal]] = field(default_factory=deque)
    pause: KillSignal | None = None  # waiting for an operator (see AgentPaused)


@dataclass(slots=True)
class _ScopeSignals:
    """What one conversation or agent has been told: its kill, until the kill expires."""

    signal_ids: set[str] = field(default_factory=set)
    kill: KillSignal | None = None


@dataclass(slots=True)
class _ToolSignals:
    """What one tool name has been told, per server ("" for none): the newest signal."""

    signal_ids: set[str] = field(default_factory=set)
    by_server: OrderedDict[str, KillSignal] = field(default_factory=OrderedDict)


# Servers remembered per tool name (the least recently told forgotten first).
MAX_SERVERS_PER_TOOL = 1000


class SignalBook:
    """Kill and downgrade signals per trace, read by the agent's `check()`.

    - `deliver(signal)` records a signal; a signal id already recorded for its trace is ignored
      (Kafka redelivery, a worker replaying after a crash) and `deliver` returns False.
    - `check(trace_id)` raises `AgentKilled` once a kill is recorded for the trace, on that
      check and every later one: an agent that swallows the exception cannot carry on calling
      tools. A downgrade's system message is returned exactly once; otherwise None.
    - a `release` (an operator's `spanguard release`) lifts the trace's kill: `check` passes
      again, until a later kill signal (a new signal id) kills it again. A release lifts only a
      kill detected before it was issued (their `detected_at`), whatever the book remembers: an
      old release delivered again cannot lift a newer kill.

    Scoped signals (`scope` conversation or agent) are kept apart, by what they stop: `check`
    given the trace's conversation or agent raises AgentKilled for a kill of either, until the
    kill's `expires_at` (an agent kill lasts until its budget window frees) or a later-issued
    release of the same scope. At most `max_traces` scopes are kept, the least recently
    touched forgotten first.

    Tool signals (`scope` tool) contain a tool: `check(..., tool=NAME)` and `check_tool`
    raise ToolContained (an AgentKilled) while the newest signal of that tool (by its
    `detected_at`) is a kill not yet expired; a release or the expiry lifts it. A contain
    naming no server holds for the name on every server; a check naming no server (None: the
    caller does not know it) is refused by a contain of the name on any server. Each refused
    call is counted in `tool_calls_refused`, and logged once per tool.

    Every agent process reads the whole fleet's signals, almost all of them about traces it
    never runs, so memory is bounded by `max_traces` per kind of entry:
    - signals for traces this process has not checked: the least recently touched beyond
      `max_traces` is forgotten (a flood of signals for other traces costs only those);
    - traces this process checks: the least recently checked beyond `max_traces` is forgotten
      while nothing kills it;
    - a killed trace this process has checked is not forgotten while its agent runs: a kill
      that the agent's checks depend on cannot be pushed out by other traces' signals. Once
      the trace is over (`trace_ended`, which in-process mode calls when the root span ends)
      its entry joins the other traces'; at most `max_traces` killed traces are kept besides,
      the least recently checked forgotten first.
    """

    def __init__(
        self,
        max_traces: int = DEFAULT_MAX_TRACES,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        if max_traces < 1:
            raise ValueError("max_traces must be at least 1")
        self.max_traces = max_traces
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # wakes `wait()` on any delivery
        self._others: OrderedDict[str, _TraceSignals] = OrderedDict()
        self._watched: OrderedDict[str, _TraceSignals] = OrderedDict()
        self._killed: OrderedDict[str, _TraceSignals] = OrderedDict()
        self._scopes: OrderedDict[tuple[str, ...], _ScopeSignals] = OrderedDict()
        self._tools: OrderedDict[str, _ToolSignals] = OrderedDict()
        self._clock = clock or (lambda: datetime.now(UTC))
        self.delivered = 0
        self.duplicates = 0
        self.tool_calls_refused = 0
        self.refused_by_tool: Counter[tuple[str, str]] = Counter()

    def deliver(self, signal: KillSignal) -> bool:
        """Record `signal` for its trace; False when this signal id was already recorded."""
        if signal.stops == "tool":
            return self._deliver_tool(signal)
        if signal.stops != "trace":
            return self._deliver_scoped(signal)
        trace_id = signal.trace_id.lower()
        with self._lock:
            entry = self._killed.get(trace_id) or self._watched.get(trace_id)
            if entry is None:
                entry = self._others.get(trace_id)
                if entry is None:
                    entry = self._others[trace_id] = _TraceSignals()
                    _trim(self._others, self.max_traces)
                else:
                    self._others.move_to_end(trace_id)
            if not self._first_sight(entry, signal):
                return False
            if signal.kind == "pause":
                if entry.kill is None:
                    entry.pause = signal
                return True
            if signal.kind in ("release", "kill"):
                entry.pause = None  # the operator's answer to a pause
            if signal.kind == "release":
                # An operator's release: the agent may call tools again. The ids seen stay, so a
                # redelivered old kill is still a duplicate; a new kill (a new id) kills again.
                if entry.kill is not None and not _issued_after(signal, entry.kill):
                    return True  # it answers an earlier kill, not this one
                entry.kill = None
                if trace_id in self._killed:
                    self._watched[trace_id] = self._killed.pop(trace_id)
                    _trim(self._watched, self.max_traces)
            elif signal.kind == "kill":
                if entry.kill is None:  # the first kill's reason is the one the agent sees
                    entry.kill = signal
                if trace_id in self._watched:  # its agent checks it: keep it
                    self._killed[trace_id] = self._watched.pop(trace_id)
                    _trim(self._killed, self.max_traces)
            else:
                message = signal.system_message or _fallback_message(signal)
                entry.unread_messages.append((message, signal))
            return True

    def _first_sight(
        self, entry: _TraceSignals | _ScopeSignals | _ToolSignals, signal: KillSignal
    ) -> bool:
        """Count `signal` into `entry` (under the lock); False when its id was seen before."""
        if signal.signal_id in entry.signal_ids:
            self.duplicates += 1
            return False
        entry.signal_ids.add(signal.signal_id)
        self.delivered += 1
        self._changed.notify_all()
        return True

    def _deliver_scoped(self, signal: KillSignal) -> bool:
        key = signal.scope_key()
        with self._lock:
            entry = self._scopes.get(key)
            if entry is None:
                entry = self._scopes[key] = _ScopeSignals()
                _trim(self._scopes, self.max_traces)
            else:
                self._scopes.move_to_end(key)
            if not self._first_sight(entry, signal):
                return False
            if signal.kind == "release":
                if entry.kill is not None and _issued_after(signal, entry.kill):
                    entry.kill = None
            elif signal.kind == "kill" and (
                entry.kill is None or _expires_later(signal, entry.kill)
            ):
                entry.kill = signal  # the longest-lasting kill of the scope holds
            return True

    def _deliver_tool(self, signal: KillSignal) -> bool:
        tool = signal.tool
        if tool is None:
            return False
        with self._lock:
            entry = self._tools.get(tool.name)
            if entry is None:
                entry = self._tools[tool.name] = _ToolSignals()
                _trim(self._tools, self.max_traces)
            else:
                self._tools.move_to_end(tool.name)
            if not self._first_sight(entry, signal):
                return False
            newest = entry.by_server.get(tool.server)
            if newest is None or _issued_after(signal, newest):
                entry.by_server[tool.server] = signal  # the newest of the tool holds
                entry.by_server.move_to_end(tool.server)
                _trim(entry.by_server, MAX_SERVERS_PER_TOOL)
            return True

    def contained(self, tool: str, server: str | None = None) -> KillSignal | None:
        """The contain in force for `tool` (on `server`; None: any server), else None."""
        with self._lock:
            return self._contained(tool, server)

    def _contained(self, tool: str, server: str | None) -> KillSignal | None:
        entry = self._tools.get(tool)
        if entry is None:
            return None
        if server is None:
            candidates = list(entry.by_server.values())
        else:
            candidates = [entry.by_server[name] for name in {server, ""} if name in entry.by_server]
        now = self._clock()
        for signal in candidates:
            if signal.kind == "kill" and not signal.expired(now):
                return signal
        return None

    def check_tool(self, tool: str | None, server: str | None = None) -> None:
        """Raise ToolContained if `tool` is contained (see the class); None checks nothing."""
        if not tool:
            return
        with self._lock:
            signal = self._contained(tool, server) if self._tools else None
        if signal is not None:
            self._refuse(tool, server, signal)

    def _refuse(self, tool: str, server: str | None, signal: KillSignal) -> NoReturn:
        """Count the refused call, log the first per tool, raise ToolContained."""
        with self._lock:
            self.tool_calls_refused += 1
            key = (tool, server or "")
            first = key not in self.refused_by_tool
            if first and len(self.refused_by_tool) >= self.max_traces:
                first = False  # a flood of names: counted in the total only
            else:
                self.refused_by_tool[key] += 1
        refused = ToolContained(signal)
        if first:
            log.warning(
                "spanguard killswitch: %s (rule %s, signal %s); further calls to it are"
                " counted in tool_calls_refused, not logged",
                refused,
                signal.rule,
                signal.signal_id,
            )
        raise refused

    def check_scopes(
        self, conversation_id: str | None = None, agent: AgentIdentity | None = None
    ) -> None:
        """Raise AgentKilled if the conversation or the agent (its service, with its name or
        any name) is under a kill not yet expired nor released."""
        keys: list[tuple[str, ...]] = []
        if conversation_id:
            keys.append(("conversation", conversation_id))
        if agent is not None and agent.service:
            keys.append(("agent", agent.service, agent.name or ""))
            if agent.name:
                keys.append(("agent", agent.service, ""))
        if not keys:
            return
        with self._lock:
            if not self._scopes:
                return
            now = self._clock()
            for key in keys:
                entry = self._scopes.get(key)
                if entry is None or entry.kill is None:
                    continue
                if entry.kill.expired(now):
                    entry.kill = None  # its window freed: the scope goes on
                    continue
                self._scopes.move_to_end(key)
                kill = entry.kill
                break
            else:
                return
        record_on_current_span(kill)
        raise AgentKilled(kill)

    def check(
        self,
        trace_id: str,
        conversation_id: str | None = None,
        agent: AgentIdentity | None = None,
        *,
        tool: str | None = None,
        server: str | None = None,
    ) -> str | None:
        """Raise AgentKilled if `trace_id`, its conversation or its agent is killed; else
        ToolContained if the call is to a contained `tool`; else a downgrade message not yet
        read (kept for the next check when the tool is refused)."""
        self.check_scopes(conversation_id, agent)
        trace_id = trace_id.lower()
        with self._lock:
            entry = self._killed.get(trace_id)
            if entry is not None:
                self._killed.move_to_end(trace_id)
            else:
                entry = self._watched.get(trace_id)
                if entry is not None:
                    self._watched.move_to_end(trace_id)
                else:
                    # From now on this process checks the trace: its signals are its agent's.
                    entry = self._others.pop(trace_id, None) or _TraceSignals()
                    if entry.kill is None:
                        self._watched[trace_id] = entry
                        _trim(self._watched, self.max_traces)
                if entry.kill is not None:
                    self._watched.pop(trace_id, None)
                    self._killed[trace_id] = entry
                    _trim(self._killed, self.max_traces)
            pause = None
            if entry.pause is not None and entry.kill is None:
                self._pause_over(trace_id, entry)
                pause = entry.pause
            kill = entry.kill
            contain = (
                self._contained(tool, server) if kill is None and pause is None and tool else None
            )
            unread = (  # a refused call leaves the message for the next check
                entry.unread_messages.popleft()
                if kill is None and pause is None and contain is None and entry.unread_messages
                else None
            )
        # Outside the lock: the span event is the agent's own record of why it stopped or
        # was steered (killswitch/stop.py).
        if pause is not None:
            record_on_current_span(pause)
            raise AgentPaused(pause)
        if kill is not None:
            record_on_current_span(kill)
            raise AgentKilled(kill)
        if contain is not None and tool:
            self._refuse(tool, server, contain)
        if unread is None:
            return None
        message, downgrade = unread
        record_on_current_span(downgrade)
        return message

    # -- pause: the one place that blocks -------------------------------------------------

    def wait(self, trace_id: str, timeout: float | None = None) -> str | None:
        """`check()`, and while the trace is paused, block until an operator answers: a
        release returns (the agent goes on), a kill raises AgentKilled; unanswered at the
        pause's `pause_until`, its fallback applies (kill raises, release returns). With
        `timeout`, AgentPaused is raised again once that many seconds have passed. Blocks the
        calling thread: from asyncio, run it in a thread (`asyncio.to_thread`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.check(trace_id)
            except AgentPaused as paused:
                left = _seconds_until(paused.until)
                if deadline is not None:
                    if time.monotonic() >= deadline:
                        raise
                    left = min(left, deadline - time.monotonic())
                with self._changed:
                    # Woken by any delivery; a short cap keeps the deadline exact either way.
                    self._changed.wait(max(0.0, min(left, 1.0)))

    def _pause_over(self, trace_id: str, entry: _TraceSignals) -> None:
        """Past its `pause_until` with no answer: the policy's fallback applies (lock held)."""
        pause = entry.pause
        assert pause is not None
        if _seconds_until(pause.pause_until) > 0:
            return
        entry.pause = None
        if pause.pause_fallback == "kill":
            entry.kill = replace(
                pause,
                kind="kill",
                reason=f"{pause.reason}; paused with no answer by {pause.pause_until}:"
                " the policy's fallback kills",
            )
            self._watched.pop(trace_id, None)
            self._killed[trace_id] = entry
            _trim(self._killed, self.max_traces)

    def is_killed(self, trace_id: str) -> bool:
        trace_id = trace_id.lower()
        with self._lock:
            if trace_id in self._killed:
                return True
            entry = self._watched.get(trace_id) or self._others.get(trace_id)
            return entry is not None and entry.kill is not None

    def trace_ended(self, trace_id: str) -> None:
        """The trace is over in this process (its root span ended): what it was told joins the
        other traces' entries, kept while room allows (a late check still sees its kill)."""
        trace_id = trace_id.lower()
        with self._lock:
            entry = self._killed.pop(trace_id, None) or self._watched.pop(trace_id, None)
            if entry is not None:
                self._others[trace_id] = entry
                self._others.move_to_end(trace_id)
                _trim(self._others, self.max_traces)

    def forget(self, trace_id: str) -> None:
        """Drop everything about `trace_id` (its agent is done with it)."""
        trace_id = trace_id.lower()
        with self._lock:
            for entries in (self._others, self._watched, self._killed):
                entries.pop(trace_id, None)

    @property
    def tracked_scopes(self) -> int:
        with self._lock:
            return len(self._scopes) + len(self._tools)

    @property
    def tracked_traces(self) -> int:
        # Not __len__ on purpose: an empty book must stay truthy, or `signals or SignalBook()`
        # would swap a shared (still empty) book for a private one.
        with self._lock:
            return len(self._others) + len(self._watched) + len(self._killed)


def _seconds_until(moment: str | None) -> float:
    if not moment:
        return 0.0
    return (datetime.fromisoformat(moment) - datetime.now(UTC)).total_seconds()


def _expires_later(signal: KillSignal, than: KillSignal) -> bool:
    try:
        return datetime.fromisoformat(signal.expires_at) > datetime.fromisoformat(than.expires_at)
    except (TypeError, ValueError):
        return False


def _trim(entries: OrderedDict[Any, Any], limit: int) -> None:
    while len(entries) > limit:
        entries.popitem(last=False)


def _issued_after(release: KillSignal, kill: KillSignal) -> bool:
    """Whether `release` was issued at or after `kill` was detected. Signals read from Kafka
    carry RFC 3339 times with a zone (read_signal checks them); should either time still be
    unreadable, the operator's release is obeyed."""
    try:
        return datetime.fromisoformat(release.detected_at) >= datetime.fromisoformat(
            kill.detected_at
        )
    except (TypeError, ValueError):
        return True


def _fallback_message(signal: KillSignal) -> str:
    # The schema asks a downgrade to carry its message; a signal without one still says why.
    return (
        f"spanguard: {signal.reason}. Try a different approach or stop and report what you found."
    )


def current_trace_id() -> str | None:
    """The 32-hex trace id of the current OpenTelemetry span, or None outside any span.

    OpenTelemetry keeps the current span in a contextvar, so this is right per thread and per
    asyncio task. The API is imported here, not at module level: the Kafka killswitch must not
    require it of an agent that registers its traces explicitly.
    """
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x")


# Where a process's conversation is named in OpenTelemetry baggage, first present wins (the
# detection side reads the same names off spans: spanguard/detection/conventions/keys.py).
CONVERSATION_BAGGAGE_KEYS = ("gen_ai.conversation.id", "session.id")


def current_conversation_id() -> str | None:
    """The conversation named in the current OpenTelemetry baggage, or None."""
    try:
        from opentelemetry import baggage
    except ImportError:
        return None
    for name in CONVERSATION_BAGGAGE_KEYS:
        value = baggage.get_baggage(name)
        if isinstance(value, str) and value:
            return value
    return None


def agent_of(resource: Any) -> AgentIdentity | None:
    """The agent an OpenTelemetry resource names: `service.name`, with `gen_ai.agent.name`
    when set; None without a service name (or without a resource)."""
    attributes = getattr(resource, "attributes", None) or {}
    service = attributes.get("service.name")
    if not isinstance(service, str) or not service:
        return None
    name = attributes.get("gen_ai.agent.name")
    return AgentIdentity(service, name if isinstance(name, str) and name else None)


def current_agent(provider: Any = None) -> AgentIdentity | None:
    """The agent an OpenTelemetry resource names, from the first of these that names one: the
    resource of `provider` when given; the current span's (an SDK span carries its provider's
    resource, so an agent on a provider of its own is found too); without `provider`, the
    global tracer provider's. The same order as the TypeScript and Go clients (the global
    provider last: theirs keep it private)."""
    if provider is not None:
        given = agent_of(getattr(provider, "resource", None))
        if given is not None:
            return given
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    from_span = agent_of(getattr(trace.get_current_span(), "resource", None))
    if from_span is not None or provider is not None:
        return from_span
    return agent_of(getattr(trace.get_tracer_provider(), "resource", None))
