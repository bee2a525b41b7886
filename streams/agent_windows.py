"""The agent scope over time in the worker: a repartition of compact usage records by agent.

An agent's traces land on every partition (they are keyed by trace id), so no span agent sees
an agent's whole spend. Instead the span agent's guard hands each change of a trace's usage to
its recorder (`AgentUsageRecorder`, the guard's agent usage sink), and the span agent sends the
batch's records to the agent usage topic, one Kafka record per agent, keyed by the agent's
identity (`agent_key`). The agent-windows agent (streams/agents/guard_agent_windows.py) reads
that topic, keeps each agent's `AgentWindow` in a table keyed by the same identity (its
changelog follows the partition a record arrives on, as the trace table's does), decides with
the pure core's code (spanguard/detection/agent_budget.py) and sends its decisions down the
trace decisions' path: detections topic, signed agent-scoped kill with its expiry, and from the
detections topic paging and the webhook. What the scopes share in the worker is
streams/scope.py's.

What the records hold (schemas/scope_records.py): the agent's identity (in the key), the trace
and span ids, the span's end time, token and micro-dollar deltas (pico-dollars on the wire, as
the core counts), and the topic partition and offset of the span message each came from; never
arguments. One Kafka record per agent and span batch, one row per agent, bucket of its window
and span message: the sum of that message's usage spans in that bucket, named after the last of
them (its trace is the one a crossing names). The window counts the same from it as from a row
per span, and a message of 80 spans sends a few rows, not 30.

Records sent twice (a span batch decided again after a crash re-sends what it had sent) are
dropped by where they came from: the span agent reads each source partition in order and sends
a batch's records before it moves on, so a window remembers the last offset it counted of each
source partition (a few hundred at most) and drops a record of an offset at or below it. Unlike
a list of recent span ids, this is exact however many records one crash re-sends.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

from spanguard.detection.agent_budget import (
    MAX_SOURCES,
    AgentBudgetGuard,
    AgentUsage,
    AgentWindow,
    bucket_seconds,
    has_agent_budget,
)
from spanguard.detection.scope import policy_for
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.schemas.decision import Decision
from spanguard.schemas.policy import Policy
from spanguard.schemas.scope_records import agent_key, decode_agent_usage, encode_agent_usage
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.delivery import Send
from spanguard.streams.scope import ScopeRecorder, scope_view

if TYPE_CHECKING:
    from spanguard.streams.wiring import Worker

__all__ = [
    "AgentUsageRecorder",
    "AgentWindowCount",
    "AgentWindowTable",
    "WorkerAgentBudgets",
    "agent_usage_sends",
    "agent_window_view",
    "agent_windows_wanted",
    "decode_usage",
    "encode_usage",
    "longest_window",
]

log = logging.getLogger("spanguard.worker")

# Agent windows one worker keeps at most: a flood of made-up agent names costs itself (its
# records are counted and dropped), never the windows of the agents already kept.
MAX_AGENTS_PER_WORKER = 10_000
# Messages logged once each: the reasons a record was refused.
MAX_TOLD = 64
MAX_AGENT_WIDTHS_KEPT = 4096  # agents whose window width is kept (bounded: a fleet has a few)

Row = tuple[AgentUsage, str | None, int]  # a usage record, its source partition, its offset


def agent_windows_wanted(policy: Policy) -> bool:
    """Whether any policy entry sets an agent budget: when none does, the worker builds none of
    it (no usage record sent, no table, no agent)."""
    return any(has_agent_budget(p) for p in policy.entries)


def longest_window(policy: Policy) -> int:
    """The longest agent budget window of any policy entry (seconds): an agent idle that long
    has nothing left in its window, so its state can go."""
    entries = policy.entries
    return max((p.agent_budget.window for p in entries if has_agent_budget(p)), default=0)


class AgentWindowCount(CountedOutcome):
    """What the agent scope over time counts in the worker."""

    RECORDS_SENT = "agent_usage_records_sent"
    RECORDS_READ = "agent_usage_records_read"
    DUPLICATES = "agent_usage_duplicates"
    # Not counted: an agent whose service name is empty (span side, told once).
    NO_IDENTITY = "agent_usage_no_identity"
    # Not counted: a new agent past MAX_AGENTS_PER_WORKER on this worker (told once).
    OVER_AGENT_CAP = "agent_usage_over_agent_cap"
    DECISIONS = "agent_window_decisions"
    LATE = "agent_window_late_spans"  # ended before the window's newest bucket: counted into it
    RESETS = "agent_window_resets"  # a span a whole window away: the window started afresh
    EVICTED = "agent_windows_evicted"


class _TellOnce:
    def __init__(self) -> None:
        self.told: set[str] = set()

    def __call__(self, what: str, message: str, *args: object) -> None:
        if what in self.told or len(self.told) >= MAX_TOLD:
            return
        self.told.add(what)
        log.warning(message, *args)


# -- the trace side: record, do not decide ----------------------------------------------------


class AgentUsageRecorder(ScopeRecorder[AgentUsage]):
    """The span agent's guard's agent usage sink: it keeps the usage records of agents whose
    policy sets an agent budget, summed per message, for the span agent to send (the
    agent-windows agent decides, from the topic)."""

    def __init__(self, policy: Policy, tally: Tally | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.tally = Tally() if tally is None else tally
        # The current message's usage: (service, agent name, bucket) -> its sum so far.
        self._summed: dict[tuple[str, str | None, int], AgentUsage] = {}
        # (service, agent name) -> the bucket width of its window, 0 when it has no budget.
        self._agent_widths: dict[tuple[str, str | None], int] = {}
        self._tell = _TellOnce()

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
        if tokens <= 0 and cost <= 0:
            return
        # Every inference span asks: the agent's window width (0: no budget) is kept per agent.
        agent = (service, agent_name)
        width = self._agent_widths.get(agent)
        if width is None:
            policy = policy_for(self.policy, service, agent_name)
            width = bucket_seconds(policy.agent_budget.window) if has_agent_budget(policy) else 0
            if len(self._agent_widths) >= MAX_AGENT_WIDTHS_KEPT:
                self._agent_widths.clear()
            self._agent_widths[agent] = width
        if not width:
            return
        if not service:
            self.tally.add(AgentWindowCount.NO_IDENTITY)
            self._tell(
                "no-identity",
                "agent budgets: usage of a trace whose service.name is empty is not counted in"
                " any agent window (counted in spanguard_agent_usage_records_total"
                '{what="no_identity"})',
            )
            return
        # One record per agent and bucket of its window for the spans of one message: the
        # window counts them the same, from a few rows instead of one per inference span.
        bucket = int((ended / 1e9) // width) if ended else 0  # as the window reckons it
        key = (service, agent_name, bucket)
        summed = self._summed.get(key)
        if summed is None:
            self._summed[key] = AgentUsage(
                service, agent_name, trace_id, span_id, ended, tokens, cost
            )
            return
        # The last span stands for the sum: a crossing is decided at it, naming its trace.
        summed.trace_id = trace_id
        summed.span_id = span_id
        if ended > summed.end_time_unix_nano:
            summed.end_time_unix_nano = ended
        summed.tokens += tokens
        summed.cost += cost

    def close_message(self) -> None:
        if self._summed:
            self.records.extend(self._summed.values())
            self._summed.clear()


def _source_of(message: Any) -> tuple[str, int] | None:
    if message is None:
        return None
    return f"{message.topic}:{message.partition}", int(message.offset)


def encode_usage(records: Iterable[AgentUsage], sources: Iterable[Any]) -> dict[str, bytes]:
    """{agent key: one record value holding the agent's usage rows, in order}; `sources`,
    aligned with `records`, are the messages they came from (None: no source)."""
    return encode_agent_usage(records, [_source_of(message) for message in sources])


def decode_usage(
    key: bytes | None, value: bytes | None
) -> tuple[tuple[str, str | None], list[Row]]:
    """The agent and the usage rows of one message of the agent usage topic; ValueError says
    what is wrong."""
    return decode_agent_usage(key, value, AgentUsage)


def agent_usage_sends(worker: Worker, records: list[AgentUsage], sources: list[Any]) -> list[Send]:
    """The span agent's records for the agent usage topic, one per agent, in order; a record
    that cannot be written leaves a dead letter pointing at the first message that
    contributed to it (`sources` is aligned with `records`)."""
    topic = worker.agent_usage_out
    assert topic is not None
    first_source: dict[str, Any] = {}
    for record, source in zip(records, sources, strict=True):
        first_source.setdefault(agent_key(record.service, record.agent_name), source)
    return [
        Send(
            topic,
            {"key": key.encode(), "value": value},
            source=first_source[key],
            deferred=True,
        )
        for key, value in encode_usage(records, sources).items()
    ]


# -- the agent side: decide ---------------------------------------------------------------


def agent_window_view(
    table: MutableMapping[bytes, bytes], bucket_seconds: float = 60.0, cache_size: int = 0
) -> DecodedStates:
    """The agent window table as the scope reads it: AgentWindows."""
    return scope_view(table, AgentWindow.from_bytes, bucket_seconds, cache_size)


class AgentWindowTable(MutableMapping[tuple[str, str | None], AgentWindow]):
    """The core's (service, agent name) keys over the table's text keys (`agent_key`)."""

    def __init__(self, states: DecodedStates) -> None:
        self.states = states

    def __getitem__(self, key: tuple[str, str | None]) -> AgentWindow:
        # (DecodedStates is typed by the trace state; this table's codec makes AgentWindows.)
        return self.states[agent_key(*key)]  # type: ignore[return-value]

    def get(self, key: tuple[str, str | None], default: Any = None) -> Any:
        return self.states.get(agent_key(*key), default)

    def __setitem__(self, key: tuple[str, str | None], window: AgentWindow) -> None:
        self.states[agent_key(*key)] = window  # type: ignore[assignment]

    def __delitem__(self, key: tuple[str, str | None]) -> None:
        del self.states[agent_key(*key)]

    def __iter__(self) -> Iterator[tuple[str, str | None]]:
        for text in self.states:
            service, agent_name = json.loads(text)
            yield service, agent_name

    def __len__(self) -> int:
        return len(self.states)


class WorkerAgentBudgets(AgentBudgetGuard):
    """The agent budgets over the worker's table: rows counted before (the same source
    partition at or below the offset last counted) are dropped, and a new agent past
    `max_agents` on this worker is not kept."""

    def __init__(
        self,
        policy: Policy,
        states: DecodedStates,
        tally: Tally | None = None,
        max_agents: int = MAX_AGENTS_PER_WORKER,
        **kwargs: Any,
    ) -> None:
        super().__init__(policy, windows=AgentWindowTable(states), max_agents=max_agents, **kwargs)
        self.states = states
        self.tally = Tally() if tally is None else tally
        self._tell = _TellOnce()

    def observe_rows(self, agent: tuple[str, str | None], rows: list[Row]) -> list[Decision]:
        """One message's rows of one agent: each counted once, the decisions taken."""
        start = self.windows.get(agent)
        if start is None and self.states.indexed() >= self.max_agents:
            self.tally.add(AgentWindowCount.OVER_AGENT_CAP, len(rows))
            self._tell(
                "cap",
                "agent budgets: more than %d agents on this worker; the usage of new ones is"
                ' not counted (spanguard_agent_usage_records_total{what="over_agent_cap"})',
                self.max_agents,
            )
            return []
        if start is not None:
            # Kept in the batch's windows: the core's own read below is a dict lookup.
            self.windows[agent] = start
        counted_before = dict(start.sources) if start is not None else {}
        late, resets = (start.late, start.resets) if start is not None else (0, 0)
        reached: dict[str, int] = {}
        decisions: list[Decision] = []
        for usage, source, offset in rows:
            if source is not None:
                if offset <= counted_before.get(source, -1):
                    self.tally.add(AgentWindowCount.DUPLICATES)
                    continue
                reached[source] = max(reached.get(source, -1), offset)
            decision = self.observe_usage(usage)
            if decision is not None:
                decisions.append(decision)
        self.take()  # returned here; the core also keeps them for a guard that would collect
        window = self.windows.get(agent)
        if window is None:  # no budget for this agent: nothing kept
            return decisions
        self.tally.add(AgentWindowCount.LATE, max(window.late - late, 0))
        self.tally.add(AgentWindowCount.RESETS, max(window.resets - resets, 0))
        if reached:
            sources = window.sources
            for source, offset in reached.items():
                sources.pop(source, None)  # most recently counted last
                sources[source] = offset
            while len(sources) > MAX_SOURCES:
                del sources[next(iter(sources))]
            self.windows[agent] = window
        return decisions
