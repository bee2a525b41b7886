"""The fleet view: one broken tool (or model) across many agents is one incident.

The trace guard decides per trace; a shared tool that breaks (an index gone stale, an MCP
server answering 401) makes every agent that uses it fail at once, and a hundred traces killed
one by one are one cause. This module is the pure kernel of the tool scope: a sliding
time window per tool, the fleet rules over it, and their settings. No I/O: the streaming scope
feeds it (`FleetWindow.observe`, `observe_decision`, `tick`) and keeps or rebuilds its state.

What is counted, per tool key, in steps of `step` seconds over `window` seconds (record time,
the spans' end times, so a replay decides what a live run decided):
- calls, failures (the span says so: status ERROR or `error.type`, or the result is
  error-shaped: results.py's ERROR marker), empty results (results.py's EMPTY: "No results",
  `[]`; a result of nothing at all, `""` or null, is what a `think` tool answers: not counted),
  trace-level decisions that named the tool, and the distinct traces and agents that called it
  (exact, in capped maps: see MAX_TRACES and MAX_AGENTS).
- The key is the tool's name and, where the span names one, its server: the OpenTelemetry MCP
  conventions put a tool call's server in `server.address` and `server.port` (there is no
  `mcp.server.*` attribute; a stdio server has no address). `gen_ai.tool.type` is the tool's
  kind (`function`, `extension`, `datastore`), not where it runs: it is not part of the key.
- A model is a key too (`model:` provider/model, `model_call`): its calls and failures.

The rules (each at most one open incident per key, the first to cross wins):
- `tool_failing`: the traces whose last call of the key in the window failed or found nothing
  number at least `min_traces` and at least `min_fraction` of the traces that called it.
- `loop_signature`: one (tool, args hash) decided on (killed, or flagged in shadow mode) in at
  least `loop_traces` distinct traces of the window.
The threshold is checked on every observation (and on `tick`, as traces leave the window), so
an incident is decided on the span that crosses it. It recovers when `recover_after` distinct
traces got an answer (not a failure, not empty) since it opened (for a loop signature, since
its last decision, and none for a whole window); the key then counts afresh.

Bad input: names are bounded (MAX_NAME_CHARS); at most `max_tools` keys are tracked, the rest
folded into one overflow key that never decides (`overflow_calls` counts them); spans without a
tool name are not counted (`unnamed`); an event more than a window ahead of the fleet's clock or
behind it is counted (`clock_jumps`) and ignored, and RESYNC_EVENTS such events in a row restart
the window at the new time (`clock_resets`): one bad clock cannot pin the window, and a fleet
whose clock really moved is followed. The scope ticks the clock with its stream time
(`tick`), so a fleet quiet for longer than a window resumes without a jump.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from mypy_extensions import mypyc_attr

from spanguard.detection.conventions.events import ToolCall
from spanguard.detection.conventions.keys import (
    ERROR_TYPE,
    INFERENCE_OPERATIONS,
    OPERATION,
    PROVIDER_KEYS,
    REQUEST_MODEL_KEYS,
    STATUS_ERROR,
)
from spanguard.detection.conventions.values import bounded_text
from spanguard.detection.results import EMPTY, ERROR
from spanguard.detection.rules.base import FLAG
from spanguard.detection.scope import ScopeGuard
from spanguard.detection.trace_state import StateDecodeError, encode_record
from spanguard.schemas.decision import (
    NO_SPAN_ID,
    AgentIdentity,
    Decision,
    DecisionScope,
    Evidence,
)
from spanguard.schemas.policy import FleetPolicy, Policy

__all__ = [
    "FLEET_RULES",
    "LOOP_SIGNATURE",
    "TOOL_FAILING",
    "FleetCall",
    "FleetGuard",
    "FleetIncident",
    "FleetWindow",
    "ToolCallSink",
    "agent_label",
    "decided_tools",
    "incident_decision",
    "incident_trace_id",
    "model_call",
    "server_of",
    "tool_call",
    "window_from_bytes",
    "window_to_bytes",
]

TOOL_FAILING: Final = "tool_failing"
LOOP_SIGNATURE: Final = "loop_signature"
FLEET_RULES: Final = (TOOL_FAILING, LOOP_SIGNATURE)
RECOVERED: Final = "recovered"  # an incident's second and last record: the tool answers again
# Who an incident's record names as its agent: it is no one agent's (evidence.agents lists them).
FLEET_AGENT: Final = AgentIdentity("(fleet)")

# The MCP conventions' server of a client span (semantic-conventions-genai, docs/gen-ai/mcp.md).
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
OVERFLOW_TOOL: Final = "(other tools)"
MODEL_PREFIX: Final = "model:"
# A name a key is made of: a megabyte-long tool name costs this much, still one key per name.
MAX_NAME_CHARS: Final = 120
# Per key: traces and agents remembered with when they last called (exact distinct counts up
# to the cap; past it the least recently seen is forgotten, counted in `forgotten`).
MAX_TRACES: Final = 4096
MAX_AGENTS: Final = 512
MAX_SIGNATURES: Final = 64  # args hashes decided on, per key
MAX_LISTED: Final = 20  # traces and agents an incident names
RESYNC_EVENTS: Final = 64


# Made per tool and inference span, short-lived, in no reference cycle: as the span events
# (conventions/events.py), its __init__ is written out so that the compiled core compiles it.
@mypyc_attr(acyclic=True, free_list_len=1)
@dataclass(slots=True, init=False)
class FleetCall:
    """One tool (or model) call as the fleet counts it: cheap to make on every tool span."""

    tool: str
    server: str  # "" when the span names none
    trace_id: str
    agent: str
    end_time_unix_nano: int
    failed: bool
    empty: bool

    def __init__(
        self,
        tool: str,
        server: str,
        trace_id: str,
        agent: str,
        end_time_unix_nano: int,
        failed: bool,
        empty: bool,
    ) -> None:
        self.tool = tool
        self.server = server
        self.trace_id = trace_id
        self.agent = agent
        self.end_time_unix_nano = end_time_unix_nano
        self.failed = failed
        self.empty = empty


def _name(text: str) -> str:
    return text if len(text) <= MAX_NAME_CHARS else bounded_text(text, MAX_NAME_CHARS)


def server_of(attributes: Any) -> str:
    """The server a tool span names (`server.address`, with `server.port`), or "".

    `attributes` is a span's attribute map (schemas/otlp_view.py) or a plain dict of values."""
    if SERVER_ADDRESS not in attributes:
        return ""
    address = _plain(attributes[SERVER_ADDRESS])
    if not address:
        return ""
    port = _plain(attributes[SERVER_PORT]) if SERVER_PORT in attributes else ""
    return _name(f"{address}:{port}" if port else address)


def _plain(value: Any) -> str:
    if isinstance(value, str | int):
        return str(value)
    text = value.string_value  # an AnyValue
    if text:
        return str(text)
    return str(value.int_value) if value.int_value else ""


def tool_call(
    call: ToolCall, result: str | None, trace_id: str, agent: str, server: str = ""
) -> FleetCall:
    """The fleet's view of a guard ToolCall; `result` is the result part of the guard's key of
    the call (results.result_key: ERROR, EMPTY, a hash, or None when not recorded)."""
    return FleetCall(
        _name(call.tool_name),
        server,
        trace_id,
        agent,
        call.end_time_unix_nano,
        call.failed or result == ERROR,
        result == EMPTY,
    )


def model_call(span: Any, trace_id: str, agent: str) -> FleetCall | None:
    """An inference span (GenAI `chat` and its kin) as a call of its model: `model:` provider
    and model as the key, failed when the span says so. None for any other span."""
    attributes = span.attributes
    # `get`, one lookup a key where `in` then the value are two: every span but a tool's is
    # asked (an attribute map's values are messages, never None).
    operation = attributes.get(OPERATION)
    if operation is None or operation.string_value not in INFERENCE_OPERATIONS:
        return None
    provider = model = ""
    for key in PROVIDER_KEYS:
        value = attributes.get(key)
        if value is not None:
            provider = _plain(value)
            break
    for key in REQUEST_MODEL_KEYS:
        value = attributes.get(key)
        if value is not None:
            model = _plain(value)
            break
    failed = span.status.code == STATUS_ERROR or ERROR_TYPE in attributes
    name = _name(f"{MODEL_PREFIX}{provider or 'unknown'}/{model or 'unknown'}")
    return FleetCall(name, "", trace_id, agent, span.end_time_unix_nano, failed, False)


@dataclass(slots=True)
class FleetIncident:
    """One incident: one cause (a key and a rule), with the window's figures when it opened
    and the traces and agents it hit (at most MAX_LISTED each)."""

    rule: str
    tool: str
    server: str
    opened_at_ns: int
    opened_step: int
    figures: dict[str, int]
    traces: list[str]
    agents: list[str]
    signature: str | None = None  # loop_signature: the args hash
    recovered_at_ns: int = 0  # 0 while open
    recovering: list[str] = field(default_factory=list)  # traces answered since
    last_hit_step: int = 0  # loop_signature: the step of the last decision on the signature

    @property
    def open(self) -> bool:
        return self.recovered_at_ns == 0

    @property
    def dedup_key(self) -> str:
        """One page per cause and window: the key and the step it opened at."""
        at = f"@{self.server}" if self.server else ""
        return f"fleet:{self.rule}:{self.tool}{at}:{self.opened_step}"


class _Key:
    """One key's window: step buckets, the traces and agents that called, the signatures
    decided on, and its open incident."""

    __slots__ = (
        "agents",
        "bad",
        "buckets",
        "forgotten",
        "fresh_after",
        "incident",
        "server",
        "signatures",
        "tool",
        "traces",
    )

    def __init__(self, tool: str, server: str, steps: int) -> None:
        self.tool = tool
        self.server = server
        # Per step, BUCKET ints: [step, calls, failures, empties, decisions, traces, agents].
        self.buckets: list[int] = [-1, 0, 0, 0, 0, 0, 0] * steps
        # trace -> last step * 2 + 1 when its last call failed or found nothing; least
        # recently seen first.
        self.traces: OrderedDict[str, int] = OrderedDict()
        self.bad = 0  # traces whose last call failed or found nothing
        self.agents: OrderedDict[str, int] = OrderedDict()  # agent -> last step
        # args hash -> {trace: step decided}
        self.signatures: dict[str, dict[str, int]] = {}
        self.incident: FleetIncident | None = None
        self.forgotten = 0
        # When its last incident recovered (ns): a call that ended before it and arrives late
        # (another partition's, a slower worker's) failed in that incident, not in a new one.
        self.fresh_after = 0


BUCKET: Final = 7
_CALLS, _FAILURES, _EMPTIES, _DECISIONS, _TRACES, _AGENTS = 1, 2, 3, 4, 5, 6
FIGURES: Final = ("calls", "failures", "empties", "decisions", "trace_steps", "agent_steps")


class FleetWindow:
    """The fleet's sliding window over every key, and its rules. Pure: feed it calls
    (`observe`), trace-level decisions (`observe_decision`) and the clock (`tick`); each
    returns the incidents it opened or recovered."""

    def __init__(self, policy: FleetPolicy | None = None) -> None:
        self.policy = policy or FleetPolicy()
        self.step_ns = self.policy.step * 1_000_000_000
        self.steps = self.policy.steps
        self.keys: dict[tuple[str, str], _Key] = {}
        self.overflow = _Key(OVERFLOW_TOOL, "", self.steps)
        self.now = -1  # the fleet's clock: the newest step seen
        self.incidents: list[FleetIncident] = []  # every incident, in order (bounded below)
        self.unnamed = 0
        self.overflow_calls = 0
        self.clock_jumps = 0
        self.clock_resets = 0
        self._jump_run = 0
        # The worker's: the last offset counted of each source partition (its records sent
        # again after a crash are dropped by it); unused in process.
        self.sources: dict[str, int] = {}
        self.last_seen = 0.0  # the worker's: wall clock of the last change (its eviction's)

    # The clock ---------------------------------------------------------------------------

    def _step_of(self, time_ns: int) -> int:
        """The step of an event, or -1 when its clock is off (counted, ignored)."""
        step = time_ns // self.step_ns
        if self.now < 0:
            self.now = step
            return step
        if self.now - self.steps < step <= self.now + self.steps:
            self._jump_run = 0
            return step
        self.clock_jumps += 1
        self._jump_run += 1
        if self._jump_run < RESYNC_EVENTS:
            return -1
        self.clock_resets += 1
        self._jump_run = 0
        self.keys.clear()  # a window of another time: counted afresh from the new one
        self.overflow = _Key(OVERFLOW_TOOL, "", self.steps)
        self.now = step
        return step

    def tick(self, time_ns: int) -> list[FleetIncident]:
        """Move the clock to `time_ns` if later (the scope's stream time, trusted where a span's
        clock is not): traces older than the window leave it, which may cross a threshold.
        Returns the incidents opened."""
        step = time_ns // self.step_ns
        if self.now < 0 or step <= self.now:
            return []
        self.now = step
        opened: list[FleetIncident] = []
        for key in list(self.keys.values()):
            self._expire(key)
            incident = self._check_failing(key, time_ns)
            if incident is not None:
                opened.append(incident)
            elif not key.traces and key.incident is None and not key.signatures:
                del self.keys[(key.tool, key.server)]  # idle: its slot is free again
        return opened

    # Calls ---------------------------------------------------------------------------------

    def _key(self, tool: str, server: str) -> _Key | None:
        key = self.keys.get((tool, server))
        if key is None:
            if len(self.keys) >= self.policy.max_tools:
                self.overflow_calls += 1
                return None
            key = self.keys[(tool, server)] = _Key(tool, server, self.steps)
        return key

    def observe(self, call: FleetCall) -> FleetIncident | None:
        """Count one call; the incident it opened or recovered, if any."""
        return self.count_call(
            call.tool,
            call.server,
            call.trace_id,
            call.agent,
            call.end_time_unix_nano,
            call.failed,
            call.empty,
        )

    def observe_summed(
        self,
        tool: str,
        server: str,
        trace_id: str,
        agent: str,
        end_time_unix_nano: int,
        summed: tuple[int, int, int, int],
    ) -> list[FleetIncident]:
        """A trace's calls of one key in one span message, summed as the tool call topic's
        rows carry them (`summed`: calls, failures, empties, how the last one ended: 0
        answered, 1 failed, 2 empty). The calls before the last are counted, not judged: they
        ended before it, and the trace fails or answers as its last call did, so an answer
        before a failure is no sign of recovery nor a failure before an answer one of
        failing. The incidents the last call opened or recovered."""
        calls, failures, empties, last = summed
        earlier = (calls - 1, failures - (last == 1), empties - (last == 2)) if calls > 1 else None
        incident = self.count_call(
            tool, server, trace_id, agent, end_time_unix_nano, last == 1, last == 2, earlier
        )
        return [] if incident is None else [incident]

    def count_call(
        self,
        tool: str,
        server: str,
        trace_id: str,
        agent: str,
        end_time_unix_nano: int,
        failed: bool,
        empty: bool,
        earlier: tuple[int, int, int] | None = None,
    ) -> FleetIncident | None:
        """`observe` of a call given field by field: a summed row's calls are counted
        without a FleetCall made for each. `earlier`: the row's calls before this one
        (calls, failures, empties), in the step's figures only (this call counts the trace
        and its agent)."""
        if not tool:
            self.unnamed += 1 if earlier is None else 1 + earlier[0]
            return None
        step = self._step_of(end_time_unix_nano)
        if step < 0:
            return None
        if step > self.now:
            self.now = step
            for each in self.keys.values():
                self._expire(each)
        key = self._key(tool, server)
        if key is None:
            if earlier is not None:
                self.overflow_calls += earlier[0]  # `_key` counted this call
                _count_earlier(self.overflow, step, earlier)
            _count(self.overflow, step, failed, empty, trace_id, agent)
            return None
        if earlier is not None:
            _count_earlier(key, step, earlier)
        bad = (failed or empty) and end_time_unix_nano >= key.fresh_after
        _count(key, step, failed, empty, trace_id, agent)
        previous = key.traces.get(trace_id)
        if previous is None:
            if len(key.traces) >= MAX_TRACES:
                _forget_oldest(key)
            key.traces[trace_id] = step * 2 + bad
            key.bad += bad
        else:
            key.bad += bad - (previous & 1)
            last = max(previous >> 1, step)
            key.traces[trace_id] = last * 2 + bad
            if last != previous >> 1:
                key.traces.move_to_end(trace_id)
        incident = key.incident
        if incident is not None:
            if not bad:
                return self._recovering(key, incident, trace_id, end_time_unix_nano)
            return None
        if bad:
            return self._check_failing(key, end_time_unix_nano)
        return None

    def _recovering(
        self, key: _Key, incident: FleetIncident, trace_id: str, end_time_unix_nano: int
    ) -> FleetIncident | None:
        recovering = incident.recovering
        if len(recovering) < self.policy.recover_after and trace_id not in recovering:
            recovering.append(trace_id)
        if len(recovering) < self.policy.recover_after:
            return None
        # A loop is over once no trace was decided on for it for a whole window: the tool
        # itself answers all along.
        if incident.signature is not None and self.now - incident.last_hit_step < self.steps:
            return None
        incident.recovered_at_ns = end_time_unix_nano or 1
        key.fresh_after = incident.recovered_at_ns
        key.incident = None
        # The key counts afresh: traces that failed before the recovery are no new failure.
        key.traces.clear()
        key.bad = 0
        key.signatures.clear()
        return incident

    def _check_failing(self, key: _Key, time_ns: int) -> FleetIncident | None:
        if key.incident is not None:
            return None
        policy = self.policy
        if key.bad < policy.min_traces or key.bad < policy.min_fraction * len(key.traces):
            return None
        hit = [trace for trace, last in reversed(key.traces.items()) if last & 1]
        return self._open(key, TOOL_FAILING, time_ns, hit[:MAX_LISTED], None)

    def _open(
        self, key: _Key, rule: str, time_ns: int, traces: list[str], signature: str | None
    ) -> FleetIncident:
        figures = self.figures(key)
        figures["failing_traces"] = key.bad
        incident = FleetIncident(
            rule,
            key.tool,
            key.server,
            time_ns,
            self.now,
            figures,
            traces,
            list(reversed(key.agents))[:MAX_LISTED],
            signature,
        )
        key.incident = incident
        if len(self.incidents) >= 1024:  # a record for tests and replay, bounded
            del self.incidents[:512]
        self.incidents.append(incident)
        return incident

    # Decisions -----------------------------------------------------------------------------

    def observe_decision(
        self,
        tool: str | None,
        server: str,
        args_hash: str | None,
        trace_id: str,
        time_ns: int,
    ) -> FleetIncident | None:
        """A trace-level decision that named a tool (its evidence's tool_name, args_hash):
        counted in its step, and towards `loop_signature` when it names the arguments."""
        if not tool:
            return None
        step = self._step_of(time_ns)
        if step < 0:
            return None
        key = self._key(_name(tool), server)
        if key is None:
            return None
        at = _bucket_at(key, step)
        if at >= 0:
            key.buckets[at + _DECISIONS] += 1
        if args_hash is None:
            return None
        traces = key.signatures.get(args_hash)
        if traces is None:
            if len(key.signatures) >= MAX_SIGNATURES:
                return None
            traces = key.signatures[args_hash] = {}
        if len(traces) < MAX_TRACES:
            traces[trace_id] = step
        for trace in [trace for trace, at in traces.items() if at <= self.now - self.steps]:
            del traces[trace]
        incident = key.incident
        if incident is not None:
            if incident.signature == args_hash:
                incident.recovering.clear()  # still looping: recovery counts from here
                incident.last_hit_step = step
            return None
        if len(traces) < self.policy.loop_traces:
            return None
        hit = list(reversed(traces))[:MAX_LISTED]
        incident = self._open(key, LOOP_SIGNATURE, time_ns, hit, args_hash)
        incident.figures["signature_traces"] = len(traces)
        incident.last_hit_step = step
        return incident

    # The window ---------------------------------------------------------------------------

    def _expire(self, key: _Key) -> None:
        oldest = self.now - self.steps
        traces = key.traces
        while traces:
            trace, last = next(iter(traces.items()))
            if last >> 1 > oldest:
                break
            del traces[trace]
            key.bad -= last & 1
        agents = key.agents
        while agents and next(iter(agents.values())) <= oldest:
            agents.popitem(last=False)

    def figures(self, key: _Key) -> dict[str, int]:
        """The key's window: sums of its step buckets, and the distinct traces and agents."""
        sums = [0] * BUCKET
        oldest = self.now - self.steps
        buckets = key.buckets
        for at in range(0, len(buckets), BUCKET):
            if buckets[at] > oldest:
                for index in range(1, BUCKET):
                    sums[index] += buckets[at + index]
        figures = {name: sums[index + 1] for index, name in enumerate(FIGURES)}
        figures["traces"] = len(key.traces)
        figures["agents"] = len(key.agents)
        figures["forgotten_traces"] = key.forgotten
        return figures

    def key_figures(self, tool: str, server: str = "") -> dict[str, int] | None:
        key = self.overflow if tool == OVERFLOW_TOOL else self.keys.get((tool, server))
        return None if key is None else self.figures(key)

    def to_bytes(self) -> bytes:
        """As the worker's table keeps it (`window_to_bytes`)."""
        return window_to_bytes(self)

    def open_incidents(self) -> list[FleetIncident]:
        return [key.incident for key in self.keys.values() if key.incident is not None]


def _bucket_at(key: _Key, step: int) -> int:
    """Where the key's bucket for `step` starts in its flat list (emptied if it held an older
    step), or -1 for a late event whose bucket was reused already (too late for the figures)."""
    buckets = key.buckets
    at = (step % (len(buckets) // BUCKET)) * BUCKET
    held = buckets[at]
    if held != step:
        if held > step:
            return -1
        buckets[at : at + BUCKET] = [step, 0, 0, 0, 0, 0, 0]
    return at


def _count(key: _Key, step: int, failed: bool, empty: bool, trace_id: str, agent: str) -> None:
    buckets = key.buckets
    at = _bucket_at(key, step)
    if at >= 0:
        buckets[at + _CALLS] += 1
        buckets[at + _FAILURES] += failed
        buckets[at + _EMPTIES] += empty and not failed
        previous = key.traces.get(trace_id)
        if previous is None or previous >> 1 < step:
            buckets[at + _TRACES] += 1
    if agent:
        seen = key.agents.get(agent)
        if seen is None or seen < step:
            if at >= 0:
                buckets[at + _AGENTS] += 1
            if seen is None and len(key.agents) >= MAX_AGENTS:
                key.agents.popitem(last=False)
            key.agents[agent] = step
            key.agents.move_to_end(agent)


def _count_earlier(key: _Key, step: int, earlier: tuple[int, int, int]) -> None:
    """A summed row's calls before its last one, in the step's figures only."""
    at = _bucket_at(key, step)
    if at >= 0:
        buckets = key.buckets
        buckets[at + _CALLS] += earlier[0]
        buckets[at + _FAILURES] += earlier[1]
        buckets[at + _EMPTIES] += earlier[2]


def _forget_oldest(key: _Key) -> None:
    _trace, last = key.traces.popitem(last=False)
    key.bad -= last & 1
    key.forgotten += 1


# The incident as a decision record -------------------------------------------------------


def incident_trace_id(incident: FleetIncident) -> str:
    """The 32-hex trace id an incident's records carry: a hash of its dedup key, so the records
    of one incident taken again after a crash (or in a replay) carry the same ids."""
    return hashlib.sha256(incident.dedup_key.encode()).hexdigest()[:32]


def _iso(time_ns: int) -> str:
    return datetime.fromtimestamp(time_ns / 1e9, UTC).isoformat(timespec="milliseconds")


def _reason(incident: FleetIncident, policy: FleetPolicy) -> str:
    at = f" at {incident.server}" if incident.server else ""
    figures = incident.figures
    if incident.recovered_at_ns:
        return (
            f"{incident.rule}: {incident.tool}{at} answered again for"
            f" {len(incident.recovering)} traces; the incident is closed"
        )
    if incident.rule == LOOP_SIGNATURE:
        return (
            f"the same call of {incident.tool}{at} (args {incident.signature}) was decided on in"
            f" {figures.get('signature_traces', len(incident.traces))} traces within"
            f" {policy.window} s"
        )
    return (
        f"{figures['failing_traces']} of {figures['traces']} traces calling {incident.tool}{at}"
        f" failed or found nothing within {policy.window} s (at least {policy.min_traces} and"
        f" {policy.min_fraction:.0%} trip)"
    )


def incident_decision(
    incident: FleetIncident,
    policy: FleetPolicy,
    *,
    shadow: bool = False,
    detected: datetime | None = None,
) -> Decision:
    """An incident's record on the detections topic: scope "tool", action the policy's (`flag`
    in shadow mode, and for a model's key), or `recovered` once it has recovered (its second
    and last record).

    Its trace id and decision id derive from the incident's dedup key: taken again after a crash
    it is the same record. `detected` (default: the incident's own time, the span time that
    crossed the threshold or recovered) is when the worker decided; `span_ended_at` is always
    the incident's time."""
    recovered = not incident.open
    # A model is no tool a client checks: a contain of it would refuse nothing, so it flags.
    flags = shadow or incident.tool.startswith(MODEL_PREFIX)
    action = RECOVERED if recovered else (FLAG if flags else policy.action)
    time_ns = incident.recovered_at_ns if recovered else incident.opened_at_ns
    figures = incident.figures
    if recovered:
        hits = len(incident.recovering)
    elif incident.rule == LOOP_SIGNATURE:
        hits = figures.get("signature_traces", len(incident.traces))
    else:
        hits = figures["failing_traces"]
    ended = _iso(time_ns)
    return Decision(
        trace_id=incident_trace_id(incident),
        span_id=NO_SPAN_ID,
        rule=incident.rule,  # type: ignore[arg-type]
        action=action,
        reason=_reason(incident, policy),
        agent=FLEET_AGENT,
        detected_at=ended if detected is None else detected.isoformat(timespec="milliseconds"),
        evidence=Evidence(
            tool_name=incident.tool,
            args_hash=incident.signature,
            hits=max(hits, 1),
            window=policy.window,
            steps=figures["calls"] or None,
            agents=list(incident.agents),
        ),
        span_ended_at=ended,
        scope=DecisionScope(
            "tool",
            traces=figures["traces"] or None,
            tool=incident.tool,
            server=incident.server or None,
            trace_ids=list(incident.traces),
        ),
    )


# The window as bytes (the worker's table keeps one window per tool key) ----------------------


def _incident_row(incident: FleetIncident | None) -> list[Any] | None:
    if incident is None:
        return None
    return [
        incident.rule,
        incident.tool,
        incident.server,
        incident.opened_at_ns,
        incident.opened_step,
        incident.figures,
        incident.traces,
        incident.agents,
        incident.signature,
        incident.recovered_at_ns,
        incident.recovering,
        incident.last_hit_step,
    ]


def _incident_of(row: list[Any] | None) -> FleetIncident | None:
    if row is None:
        return None
    rule, tool, server, opened_at, opened_step, figures, traces, agents, signature = row[:9]
    incident = FleetIncident(
        rule, tool, server, opened_at, opened_step, figures, traces, agents, signature
    )
    incident.recovered_at_ns, incident.recovering, incident.last_hit_step = row[9:12]
    return incident


def window_to_bytes(window: FleetWindow) -> bytes:
    """A window of the worker's table (one key, the overflow bucket unused) as compact JSON:
    traces and agents as [name, last step] pairs, oldest first, so the order they leave the
    window in survives."""
    keys = [
        [
            key.tool,
            key.server,
            key.buckets,
            list(key.traces.items()),
            key.bad,
            list(key.agents.items()),
            key.signatures,
            _incident_row(key.incident),
            key.forgotten,
            key.fresh_after,
        ]
        for key in window.keys.values()
    ]
    counters = [window.unnamed, window.overflow_calls, window.clock_jumps, window.clock_resets]
    # `last_seen` last: the worker's eviction reads it without decoding the rest.
    return encode_record(
        {
            "n": window.now,
            "k": keys,
            "c": counters,
            "s": window.sources,
            "last_seen": window.last_seen,
        }
    )


def window_from_bytes(data: bytes, policy: FleetPolicy) -> FleetWindow:
    """The window `window_to_bytes` wrote, under `policy` (a window of other steps starts
    afresh: its buckets would not line up); StateDecodeError for bytes that hold none."""
    try:
        return _window_of(json.loads(data), policy)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise StateDecodeError(f"not a tool window: {exc!r}") from None


def _window_of(record: Any, policy: FleetPolicy) -> FleetWindow:
    window = FleetWindow(policy)
    window.sources = dict(record["s"])
    window.last_seen = float(record["last_seen"])
    window.unnamed, window.overflow_calls, window.clock_jumps, window.clock_resets = record["c"]
    for row in record["k"]:
        tool, server, buckets, traces, bad, agents, signatures, incident, forgotten = row[:9]
        key = _Key(tool, server, window.steps)
        if len(buckets) != len(key.buckets):
            continue
        key.buckets = buckets
        key.traces = OrderedDict((trace, last) for trace, last in traces)
        key.bad = bad
        key.agents = OrderedDict((agent, last) for agent, last in agents)
        key.signatures = signatures
        key.incident = _incident_of(incident)
        key.forgotten = forgotten
        key.fresh_after = row[9]
        window.keys[(tool, server)] = key
    window.now = record["n"]
    return window


# The scope in process: the trace guard's tool call sink, deciding -------------------------


def agent_label(service: str, agent_name: str | None) -> str:
    """How an incident names an agent: its service, and its name when it has one."""
    return f"{service}/{agent_name}" if agent_name else service


class ToolCallSink(Protocol):
    """Where the trace guard hands each tool call it counts, as the fleet counts it (with the
    server its span names): a FleetGuard decides on it, the worker's recorder sends it to the
    tool call topic (streams/tool_scope.py)."""

    def hand_tool_call(self, call: FleetCall) -> None: ...


def decided_tools(
    decisions: Iterable[Decision],
) -> list[tuple[str, str | None, str, int]]:
    """The trace-level decisions that name a tool, as the fleet counts them: (tool, args
    hash, trace id, when the tripping span ended, ns; 0 when unknown)."""
    named: list[tuple[str, str | None, str, int]] = []
    for decision in decisions:
        tool = decision.evidence.tool_name
        if decision.scope is not None or not tool:
            continue
        ended = decision.span_ended_at
        time_ns = int(datetime.fromisoformat(ended).timestamp() * 1e9) if ended else 0
        named.append((tool, decision.evidence.args_hash, decision.trace_id, time_ns))
    return named


class FleetGuard(ScopeGuard):
    """The tool scope in one process (replay, backtest): the guard's tool call sink over one
    FleetWindow, its incidents as decisions (`take`, with the guard's own); the trace-level
    decisions are fed back by the caller (`observe_decisions`), after the guard took them."""

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.time) -> None:
        super().__init__(policy, "tool", clock)
        self.fleet = policy.fleet
        self.window = FleetWindow(self.fleet)
        self._servers: dict[tuple[str, str], str] = {}  # (trace, tool) -> server of its calls

    @property
    def enabled(self) -> bool:
        return self.fleet.enabled

    def hand_tool_call(self, call: FleetCall) -> None:
        if call.server:
            if len(self._servers) >= MAX_TRACES:
                self._servers.clear()
            self._servers[(call.trace_id, call.tool)] = call.server
        self._decided(self.window.observe(call))

    def observe_decisions(self, decisions: Iterable[Decision]) -> None:
        for tool, args_hash, trace_id, time_ns in decided_tools(decisions):
            server = self._servers.get((trace_id, _name(tool)), "")
            found = self.window.observe_decision(tool, server, args_hash, trace_id, time_ns)
            self._decided(found)

    def _decided(self, incident: FleetIncident | None) -> None:
        if incident is None:
            return
        self.decisions += 1
        self.pending.append(incident_decision(incident, self.fleet))

    def retract(self, decision: Decision) -> None:
        """An incident's record not written: the incident is not open, it can open again."""
        scope = decision.scope
        if scope is None or scope.tool is None or decision.action == RECOVERED:
            return
        key = self.window.keys.get((scope.tool, scope.server or ""))
        incident = key.incident if key is not None else None
        if key is not None and incident is not None and incident.rule == decision.rule:
            key.incident = None
